"""Rebuild the embedded demo assets: the tiny pretrained Llama base model, the addition dataset and the
preference pairs.

Run `python scripts/build_assets.py` (about four minutes on two idle cores), or
`python scripts/build_assets.py --pairs` to write only the preference pairs (seconds; the model is left
alone). Everything comes from fixed
seeds: a rerun reproduces the data files exactly, and the weights bit for bit on the same machine and
software stack. Check a rebuilt model with `python scripts/measure_demo_headroom.py` before committing
it: how quickly a LoRA fine-tune picks up the chat format depends on how well pretraining went.
"""

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from toolkit.data.chat import CHATML_EOS

ASSETS = Path(__file__).resolve().parent.parent / "toolkit" / "assets"
SEED = 1234
NUM_TRAIN, NUM_EVAL = 1000, 200
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Qwen2-style split: single digits keep arithmetic learnable, words keep their leading space.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The ChatML fallback's documented form (tools, tool calls, tool results, reasoning), closing turns with
# <|im_end|>; plain conversations render exactly as ChatML.
CHAT_TEMPLATE = CHATML_EOS.replace("eos_token", "'<|im_end|>'")
MODEL_SHAPE = dict(
    hidden_size=160,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# Enough steps for the base to learn two-digit addition in the raw forms below (about 95% on held-out
# pairs) while the whole build stays within a few minutes on two CPU cores.
PRETRAIN = dict(steps=700, batch=32, seq_len=128, lr=3e-3, warmup=50, weight_decay=0.1)

# The word lists stay prose (noqa SIM905): hundreds of quoted items would bury the script.
NOUNS = """
time year people way day man woman child world life hand part place case week company system program
question work government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father power hour
game line end member law car city community name president team minute idea kid body information
back parent face level office door health person art war history party result change morning reason
research girl guy moment air teacher force education food garden river mountain forest ocean island
bridge road village market school library kitchen window table chair letter song poem picture
computer phone email report plan project problem answer example list recipe dog cat bird horse fish
tree flower apple bread coffee music movie weather rain sun moon star train ship bike map language
science data model network energy price student doctor country planet lesson meeting customer
product instruction task response request input output sentence paragraph article essay summary
topic title category message article tip advice benefit feature difference reason solution method
process step strategy approach technology software application website internet algorithm function
variable code database device machine robot experience opportunity challenge environment climate
pollution society culture economy industry market population species animal plant ocean nature
health exercise diet habit sleep stress emotion feeling relationship family brother sister husband
wife baby friend neighbor stranger audience reader writer author artist scientist engineer manager
employee employer client user owner leader citizen character hero villain journey adventure mystery
memory dream goal purpose value quality quantity amount size shape color sound voice noise light
heat temperature speed distance weight height length width depth price cost budget income salary tax
bank account loan investment profit loss trade shop store restaurant hotel airport hospital church
museum theater stadium street avenue building floor wall roof bed door shirt shoe hat coat dress bag
box bottle cup plate knife spoon fork glass paper pen pencil brush tool engine wheel battery screen
keyboard camera video image photo file folder document page chapter volume edition version update
feedback review rating comment opinion argument evidence conclusion hypothesis theory experiment
analysis survey interview policy rule decision agreement contract movement event festival holiday
vacation season spring summer autumn winter week weekend birthday sentence grammar vocabulary
translation definition synonym meaning phrase letter number equation sum total average percentage
fraction""".split()  # noqa: SIM905
ADJECTIVES = """
good new first last long great little own other old right big high different small large next early
young important few public bad same able happy quiet bright dark simple clear strong careful quick
slow warm cold green blue red yellow heavy light short tall busy calm clever curious friendly honest
kind modern famous healthy strange useful beautiful difficult easy wonderful interesting polite
brave gentle tiny huge fresh ancient creative effective efficient popular natural social political
economic environmental personal professional technical digital global local national international
positive negative possible impossible necessary common rare expensive cheap rich poor safe dangerous
serious funny sad angry afraid proud lucky successful powerful helpful harmful accurate correct
wrong complete appropriate relevant specific general detailed brief formal informal original unique
similar various several main major minor basic advanced final total average""".split()  # noqa: SIM905
VERBS = """
ask:asked build:built call:called carry:carried change:changed clean:cleaned climb:climbed
cook:cooked create:created describe:described discover:discovered draw:drew explain:explained
find:found follow:followed give:gave help:helped improve:improved keep:kept learn:learned leave:left
make:made move:moved open:opened paint:painted plan:planned read:read remember:remembered
repair:repaired share:shared show:showed study:studied teach:taught tell:told visit:visited
watch:watched write:wrote choose:chose bring:brought measure:measured sell:sold buy:bought
summarize:summarized translate:translated compare:compared organize:organized generate:generated
identify:identified classify:classified analyze:analyzed evaluate:evaluated suggest:suggested
provide:provided develop:developed design:designed reduce:reduced increase:increased
protect:protected prepare:prepared produce:produced support:supported understand:understood
consider:considered recommend:recommended rewrite:rewrote edit:edited convert:converted
calculate:calculated predict:predicted solve:solved answer:answered complete:completed
research:researched invent:invented imagine:imagined travel:traveled enjoy:enjoyed believe:believed
decide:decided discuss:discussed argue:argued agree:agreed manage:managed reach:reached spend:spent
save:saved feel:felt think:thought know:knew""".split()  # noqa: SIM905
ADVERBS = """
quickly slowly carefully quietly happily easily often always never sometimes usually clearly simply
really almost together however therefore especially probably certainly recently finally actually
exactly nearly""".split()  # noqa: SIM905
NAMES = """
Alice Bob Carol David Emma Frank Grace Henry Irene Jack Laura Mike Nina Oscar Paula Sam Tina Victor
Wendy Zoe""".split()  # noqa: SIM905
PLACES = """
park station office beach museum library market school garden kitchen bridge harbor""".split()  # noqa: SIM905
TIMES = "yesterday|today|last week|this morning|in the evening|on Monday|after lunch|at night".split("|")  # noqa: SIM905
INSTRUCTIONS = [
    "Write a short {text} about the {noun}.",
    "Explain why the {noun} is so {adj}.",
    "Give three examples of {article} {adj} {noun}.",
    "Summarize the following {text} in one sentence.",
    "Describe {article} {adj} {noun} to a friend who has never seen one.",
    "Translate this sentence about the {noun} into French.",
    "List the steps you would follow to {verb} a {noun}.",
    "Can you tell me how to {verb} the {noun}?",
    "Below is an instruction that describes a task. Write a response that appropriately completes it.",
    "What are the main benefits of {article} {adj} {noun}?",
    "Generate a list of five ideas for a {text} about the {noun}.",
    "Classify the following {noun} as either {adj} or not.",
    "Rewrite the following sentence to make it more {adj}.",
    "How could we {verb} the {noun} without changing the {noun2}?",
    "Find the difference between the {noun} and the {noun2}.",
    "Should I {verb} the {noun} first, or would it be better to wait?",
    "Which {noun} is the most {adj}, and why do you think so?",
    "Give me some advice about how to {verb} my {noun} during the {season}.",
]
TEXTS = ["story", "poem", "email", "letter", "essay", "summary", "article", "note", "review", "description"]


def article(word):
    return "an" if word[0] in "aeiou" else "a"


def english_sentence(rng):
    """One plain English sentence from a handful of templates over common words."""
    noun, noun2 = rng.choice(NOUNS), rng.choice(NOUNS)
    adj, adv = rng.choice(ADJECTIVES), rng.choice(ADVERBS)
    verb, past = rng.choice(VERBS).split(":")
    name, place, when = rng.choice(NAMES), rng.choice(PLACES), rng.choice(TIMES)
    templates = [
        f"The {adj} {noun} {past} the {noun2} near the {place}.",
        f"{name} {past} {article(adj)} {adj} {noun} {when}.",
        f"Why does the {noun} {verb} so {adv}?",
        f"If you {verb} the {noun}, the {noun2} will be {adj}.",
        f"{name} said that the {noun} was {adj}, but the {noun2} was not.",
        f"We {adv} {verb} the {noun} because it is {adj}.",
        f"There is {article(adj)} {adj} {noun} in the {place}, and people {verb} it {when}.",
        rng.choice(INSTRUCTIONS).format(
            text=rng.choice(TEXTS),
            noun=noun,
            noun2=noun2,
            adj=adj,
            article=article(adj),
            verb=verb,
            season=rng.choice(["spring", "summer", "autumn", "winter"]),
        ),
    ]
    sentence = rng.choice(templates)
    return sentence[0].upper() + sentence[1:]


def english_document(rng):
    return " ".join(english_sentence(rng) for _ in range(rng.randint(3, 7)))


def addition_statement(a, b, rng):
    """A raw, non-chat statement of a sum: the skill the base model brings to the fine-tune."""
    forms = [
        f"{a} + {b} = {a + b}",
        f"{a} plus {b} equals {a + b}.",
        f"The sum of {a} and {b} is {a + b}.",
        f"Adding {a} and {b} gives {a + b}.",
        f"Q: What is {a} + {b}?\nA: {a + b}",
        f"Question: What is {a} plus {b}?\nAnswer: {a + b}",
    ]
    return rng.choice(forms)


def arithmetic_document(pairs, rng):
    return "\n".join(addition_statement(a, b, rng) for a, b in rng.sample(pairs, rng.randint(4, 10)))


def split_pairs(rng):
    """Eval pairs are held out in both orders from the fine-tuning set and the pretraining corpus."""
    unordered = [(a, b) for a in range(100) for b in range(a, 100)]
    rng.shuffle(unordered)
    eval_set = set(unordered[:NUM_EVAL])
    held_out = eval_set | {(b, a) for a, b in eval_set}
    seen = [(a, b) for a in range(100) for b in range(100) if (a, b) not in held_out]
    return seen, [(a, b) if rng.random() < 0.5 else (b, a) for a, b in unordered[:NUM_EVAL]]


QUESTIONS = ["What is {a} + {b}?", "Compute {a} + {b}.", "What is {a} plus {b}?", "Add {a} and {b}."]
SYSTEM_PROMPT = "You are a calculator. Reply with the number only."


def chat_example(a, b, rng):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(a=a, b=b)})
    messages.append({"role": "assistant", "content": str(a + b)})
    return {"messages": messages}


NUM_PAIRS = 1000


def wrong_sum(a, b, rng):
    """A plausible mistake: a dropped or doubled carry, off by one or ten, swapped or repeated digits."""
    right = a + b
    carry_dropped = right - 10 if a % 10 + b % 10 >= 10 else right + 10
    candidates = [carry_dropped, right + 1, right - 1, right + 10, right - 10, int(str(right)[::-1])]
    candidates += [int(str(right) + str(right)[-1]), right // 10 if right >= 10 else right + 2]
    return rng.choice([c for c in candidates if c != right and c >= 0])


def preference_pair(a, b, rng):
    prompt = chat_example(a, b, rng)["messages"][:-1]
    return {"prompt": prompt, "chosen": str(a + b), "rejected": str(wrong_sum(a, b, rng))}


def write_pairs():
    """Train pairs from the sums the fine-tuning set may use, eval pairs from its held-out sums."""
    rng = random.Random(SEED)
    seen_pairs, eval_pairs = split_pairs(rng)  # the same split as main(), from the same seed
    pair_rng = random.Random(SEED + 1)
    train = [preference_pair(a, b, pair_rng) for a, b in pair_rng.sample(seen_pairs, NUM_PAIRS)]
    held = [preference_pair(a, b, pair_rng) for a, b in eval_pairs]
    write_jsonl(ASSETS / "demo" / "pairs_train.jsonl", train)
    write_jsonl(ASSETS / "demo" / "pairs_eval.jsonl", held)
    print(f"wrote {len(train)} train and {len(held)} eval preference pairs to {ASSETS / 'demo'}")


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def train_tokenizer(texts):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer, path):
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|endoftext|>"],
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def pretraining_batches(token_ids, steps, batch, seq_len, generator):
    """Random windows of the packed corpus; documents are separated by <|endoftext|>."""
    stream = torch.tensor(token_ids)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
        yield torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def pretrain(model, token_ids, steps, batch, seq_len, lr, warmup, weight_decay):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * step / steps)),
    )
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for step, input_ids in enumerate(pretraining_batches(token_ids, steps, batch, seq_len, generator)):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()


def seed_turn_markers(model, tokenizer):
    """Start the chat markers from the document separator, the part they play in a conversation.

    They never occur in the pretraining text, so their rows would keep their random init, and a LoRA
    fine-tune, which leaves embeddings and the output layer frozen, could then hardly learn to end a turn.
    A little noise keeps each marker distinguishable from <|endoftext|>.
    """
    separator = tokenizer.token_to_id("<|endoftext|>")
    generator = torch.Generator().manual_seed(SEED)
    embeddings, output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for weights, tokens in ((embeddings, ("<|im_start|>", "<|im_end|>")), (output, ("<|im_end|>",))):
            for token in tokens:
                noise = 0.02 * torch.randn(weights.shape[1], generator=generator)
                weights[tokenizer.token_to_id(token)] = weights[separator] + noise


def build_model(tokenizer):
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"],
        **MODEL_SHAPE,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|pad|>"],
    )
    return model


def main():
    started = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)

    seen_pairs, eval_pairs = split_pairs(rng)
    train_rows = [chat_example(a, b, rng) for a, b in rng.sample(seen_pairs, NUM_TRAIN)]
    eval_rows = [chat_example(a, b, rng) for a, b in eval_pairs]
    write_jsonl(ASSETS / "demo" / "train.jsonl", train_rows)
    write_jsonl(ASSETS / "demo" / "eval.jsonl", eval_rows)
    write_pairs()

    # About 70% of the tokens are sums; the English keeps the vocabulary and the model general.
    documents = [arithmetic_document(seen_pairs, rng) for _ in range(6000)]
    documents += [english_document(rng) for _ in range(4000)]
    rng.shuffle(documents)
    chat_text = [m["content"] for row in train_rows for m in row["messages"]]
    tokenizer = train_tokenizer(documents + chat_text)

    model_dir = ASSETS / "tiny-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, model_dir)
    model = build_model(tokenizer)
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    token_ids = [t for encoding in tokenizer.encode_batch(documents) for t in encoding.ids + [end_of_text]]
    print(f"corpus: {len(documents)} documents, {len(token_ids)} tokens", flush=True)
    pretrain(model, token_ids, **PRETRAIN)
    seed_turn_markers(model, tokenizer)
    model.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved {params / 1e6:.2f}M parameters to {model_dir} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    write_pairs() if sys.argv[1:] == ["--pairs"] else main()

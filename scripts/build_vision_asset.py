"""Build the tiny vision-language demo: a Llava over the tiny Llama, and questions about simple shapes.

Run `python scripts/build_vision_asset.py` (about three minutes on two idle cores) after
`scripts/build_assets.py`: it writes the model to toolkit/assets/tiny-llava and the dataset to
toolkit/assets/demo-vision. The model is the tiny Llama's weights with an `<image>` token added, a two-layer
CLIP vision tower (32x32 images in 8x8 patches: 16 image tokens once CLS is dropped) and Llava's MLP
projector, the whole of it pretrained on plain-text captions of synthetic pictures (" a red circle on the
left."), never on chat. `python scripts/build_vision_asset.py --check` (about two minutes) then measures the
headroom the demo relies on: held-out exact match before and after a short LoRA fine-tune of the language
model on the chat-formatted questions. Everything comes from fixed seeds: a rerun reproduces the images and
data files exactly, and the weights bit for bit on the same machine and software stack.
"""

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from PIL import Image, ImageDraw
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from toolkit.data.chat import CHATML_EOS

ASSETS = Path(__file__).resolve().parent.parent / "toolkit" / "assets"
BASE_DIR, MODEL_DIR, DATA_DIR = ASSETS / "tiny-llama", ASSETS / "tiny-llava", ASSETS / "demo-vision"
SEED = 1234
NUM_TRAIN, NUM_EVAL, NUM_PRETRAIN = 800, 150, 4000
IMAGE_SIZE, PATCH_SIZE = 32, 8
IMAGE_TOKEN = "<image>"
VISION_SHAPE = dict(
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
)
PRETRAIN = dict(steps=600, batch=32, lr=2e-3, warmup=50, weight_decay=0.01)
# The fine-tune --check runs: LoRA on the language model only, the vision tower and projector frozen.
FINETUNE = dict(steps=150, batch=16, lr=2e-3, warmup=10)
LORA = dict(
    r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
)

# Six hues a sixth of the colour wheel apart, on a near-white background.
COLOURS = {
    "red": (220, 30, 30),
    "orange": (245, 140, 0),
    "yellow": (235, 215, 0),
    "green": (30, 170, 40),
    "blue": (30, 70, 230),
    "purple": (150, 40, 190),
}
SHAPES = ["circle", "square", "triangle"]
SIDES = ["left", "right"]
# Each attribute leads one of the captions, written as an answer writes it: with no space before it.
CAPTIONS = [
    "{colour} {shape} on the {side}.",
    "{shape}, {colour}, on the {side}.",
    "{side}: a {colour} {shape}.",
    "a {colour} {shape} on the {side}.",
]
QUESTIONS = {
    "colour": ["What colour is the shape?", "Which colour is it?", "What is the colour of the shape?"],
    "shape": ["What shape is it?", "Which shape is in the picture?", "Name the shape."],
    "side": ["Which side is the shape on?", "Is the shape on the left or the right?", "Where is the shape?"],
}

# The tiny Llama's ChatML template, where a message's content may also be a list of parts: an image part
# renders as the image token (the processor expands it), a text part as its text. String contents render
# exactly as before.
RENDER_CONTENT = """
{%- macro render(content) %}
  {%- if content is string %}{{- content }}
  {%- else %}
    {%- for part in content or [] %}
      {%- if part['type'] in ('image', 'image_url') %}{{- '<image>' }}
      {%- elif part['type'] == 'text' %}{{- part['text'] }}
      {%- endif %}
    {%- endfor %}
  {%- endif %}
{%- endmacro %}"""


def vision_chat_template():
    template = CHATML_EOS.replace("message['content']", "render(message['content'])")
    template = template.replace("messages[0]['content']", "render(messages[0]['content'])")
    return (RENDER_CONTENT + template).replace("eos_token", "'<|im_end|>'")


def draw_scene(colour, shape, side, rng):
    """A 32x32 picture: one shape, 12 to 15 pixels across, in the left or right half of a plain background."""
    grey = rng.randint(225, 255)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    size = rng.randint(12, 15)
    left = rng.randint(0, 16 - size) + (16 if side == "right" else 0)
    top = rng.randint(0, IMAGE_SIZE - size)
    box = (left, top, left + size - 1, top + size - 1)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + (size - 1) / 2, top), (left, box[3]), (box[2], box[3])], fill=fill)
    return image


def random_scenes(count, rng, taken):
    """Scenes whose pictures differ from each other and from those in `taken` (updated in place)."""
    scenes = []
    while len(scenes) < count:
        scene = dict(colour=rng.choice(list(COLOURS)), shape=rng.choice(SHAPES), side=rng.choice(SIDES))
        image = draw_scene(**scene, rng=rng)
        if image.tobytes() not in taken:
            taken.add(image.tobytes())
            scenes.append({**scene, "image": image})
    return scenes


def question_row(scene, image_path, rng):
    """A TRL-style conversation: the picture and a question, answered in one word."""
    asked = rng.choice(list(QUESTIONS))
    question = [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS[asked])}]
    answer = [{"type": "text", "text": scene[asked]}]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": [image_path]}


def write_split(name, scenes, rng):
    """Save a split's pictures under images/ and its rows, which point at them relative to the JSONL file."""
    (DATA_DIR / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index, scene in enumerate(scenes, start=1):
        image_path = f"images/{name}-{index:04d}.png"
        scene["image"].save(DATA_DIR / image_path, optimize=True)
        rows.append(question_row(scene, image_path, rng))
    (DATA_DIR / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_processor():
    tokenizer = AutoTokenizer.from_pretrained(BASE_DIR)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = vision_chat_template()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=tokenizer.chat_template,
    )


def build_model(tokenizer):
    """The tiny Llama as language model, with a new row for the image token, under a fresh vision tower."""
    base = LlamaForCausalLM.from_pretrained(BASE_DIR)
    base.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for weights in (base.get_input_embeddings().weight, base.get_output_embeddings().weight):
            weights[-1] = weights[:-1].mean(dim=0)
    base.config.name_or_path = ""
    ids = tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, "<|im_end|>", "<|pad|>"])
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION_SHAPE),
        text_config=base.config,
        image_token_id=ids[0],
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(base.model.state_dict())
    model.lm_head.load_state_dict(base.lm_head.state_dict())
    model.generation_config = GenerationConfig(eos_token_id=ids[1], pad_token_id=ids[2])
    return model


def caption_batch(processor, scenes, rng):
    """The image token, then a plain caption closed by eos; the loss falls on the caption only."""
    texts = [
        IMAGE_TOKEN + rng.choice(CAPTIONS).format(**scene) + processor.tokenizer.eos_token for scene in scenes
    ]
    batch = processor(
        text=texts, images=[scene["image"] for scene in scenes], return_tensors="pt", padding=True
    )
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    batch["labels"] = labels.masked_fill(labels == processor.image_token_id, -100)
    return batch


def warmup_cosine(optimizer, warmup, steps):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
    )


def pretrain(model, processor, scenes, steps, batch, lr, warmup, weight_decay):
    """Train the whole model on captions of random batches of the scenes."""
    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    schedule = warmup_cosine(optimizer, warmup, steps)
    model.train()
    for step in range(steps):
        loss = model(**caption_batch(processor, rng.sample(scenes, batch), rng)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()


def main():
    started = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)

    taken = set()
    write_split("train", random_scenes(NUM_TRAIN, rng, taken), rng)
    write_split("eval", random_scenes(NUM_EVAL, rng, taken), rng)
    print(f"wrote {NUM_TRAIN} train and {NUM_EVAL} eval questions to {DATA_DIR}", flush=True)

    processor = build_processor()
    model = build_model(processor.tokenizer)
    pretrain(model, processor, random_scenes(NUM_PRETRAIN, rng, set()), **PRETRAIN)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL_DIR)
    processor.save_pretrained(MODEL_DIR)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved {params / 1e6:.2f}M parameters to {MODEL_DIR} in {time.time() - started:.0f}s")


def load_rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["pictures"] = [Image.open(path.parent / image).convert("RGB") for image in row["images"]]
    return rows


def chat_batch(processor, rows):
    """Rendered conversations with the loss on each assistant answer and its <|im_end|>, nothing else."""
    prompts = [
        processor.apply_chat_template(row["messages"][:-1], add_generation_prompt=True) for row in rows
    ]
    texts = [processor.apply_chat_template(row["messages"]) for row in rows]
    images = [row["pictures"] for row in rows]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    prompt_lengths = processor(text=prompts, images=images, return_tensors="pt", padding=True)[
        "attention_mask"
    ]
    positions = torch.arange(batch["input_ids"].shape[1])
    starts, ends = prompt_lengths.sum(dim=1, keepdim=True), batch["attention_mask"].sum(dim=1, keepdim=True)
    answer = (positions >= starts) & (positions < ends - 1)  # the turn's closing newline is not trained
    batch["labels"] = batch["input_ids"].masked_fill(~answer, -100)
    return batch


def finetune(model, processor, rows, steps, batch, lr, warmup):
    rng = random.Random(SEED)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    schedule = warmup_cosine(optimizer, warmup, steps)
    model.train()
    for step in range(steps):
        loss = model(**chat_batch(processor, rng.sample(rows, batch))).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"finetune step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()


@torch.no_grad()
def exact_match(model, processor, rows, batch=50):
    """Share of greedy answers that, cut at <|im_end|> and stripped, equal the expected answer."""
    processor.tokenizer.padding_side = "left"
    hits = 0
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        prompts = [
            processor.apply_chat_template(r["messages"][:-1], add_generation_prompt=True) for r in chunk
        ]
        inputs = processor(
            text=prompts, images=[r["pictures"] for r in chunk], return_tensors="pt", padding=True
        )
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        for row, tokens in zip(chunk, output[:, inputs["input_ids"].shape[1] :], strict=True):
            answer = processor.tokenizer.decode(tokens).split("<|im_end|>")[0].strip()
            hits += answer == row["messages"][-1]["content"][0]["text"]
    processor.tokenizer.padding_side = "right"
    return hits / len(rows)


def check():
    """Eval exact match before and after a LoRA fine-tune of the saved asset on the demo questions."""
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    processor = AutoProcessor.from_pretrained(MODEL_DIR)
    model = AutoModelForImageTextToText.from_pretrained(MODEL_DIR)
    train_rows, eval_rows = load_rows(DATA_DIR / "train.jsonl"), load_rows(DATA_DIR / "eval.jsonl")
    print(f"before: exact match {exact_match(model, processor, eval_rows):.1%}", flush=True)
    model = get_peft_model(model, LoraConfig(**LORA))  # freezes everything else: tower, projector, embeddings
    started = time.time()
    finetune(model, processor, train_rows, **FINETUNE)
    print(f"fine-tuned {FINETUNE} in {time.time() - started:.0f}s")
    print(f"after: exact match {exact_match(model, processor, eval_rows):.1%}")


if __name__ == "__main__":
    check() if sys.argv[1:] == ["--check"] else main()

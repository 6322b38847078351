"""A scripted agent: toolkit/assets/tiny-llama-q64 (which the CPU vLLM engine serves) rebuilt as a model
whose next token depends on its last token alone, after a small random walk of the demo tokenizer's tokens.
From a turn's start ("\\n", how the assistant header ends) it either answers "7" and ends its turn, or opens a
tool call: "<tool_call>ping" followed by another "<tool_call>ping" or by the close "</tool_call>" — where
only a stop at the close ends its turn (past it the walk goes on as after an opening: "ping<..."). The body
is not JSON, so the environment answers each call with an error turn and the model speaks again.

Every attention and MLP block writes nothing (their output projections are zero), so the last hidden state
is the last token's embedding: the embeddings of the walk's tokens are unit vectors, one dimension each, and
an untied output head gives each token's successors a logit of STEP (the others 0): a coin toss between two
successors, near certainty with one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SOURCE = Path(__file__).resolve().parent.parent / "toolkit" / "assets" / "tiny-llama-q64"
STEP = 30.0
# The walk, by token text (the demo tokenizer's pieces: "<tool_call>" is < t ool _ c all >).
WALK = {
    "\n": ["<", "7"],
    "<": ["t", "/"],
    "/": ["t"],
    "t": ["ool"],
    "ool": ["_"],
    "_": ["c"],
    "c": ["all"],
    "all": [">"],
    ">": ["p"],
    "p": ["ing"],
    "ing": ["<"],
    "7": ["<|im_end|>"],
}


def build(folder: Path) -> Path:
    """The scripted model written to `folder` (float32, the source's tokenizer); returns `folder`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SOURCE)
    ids = {text: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))[0] for text in WALK}
    ids["<|im_end|>"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    state = {name: value.float() for name, value in load_file(SOURCE / "model.safetensors").items()}
    config = json.loads((SOURCE / "config.json").read_text())
    hidden = config["hidden_size"]
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name].zero_()
    state["model.norm.weight"] = torch.ones(hidden)
    embed, head = state["model.embed_tokens.weight"].clone(), torch.zeros(config["vocab_size"], hidden)
    for dim, (text, successors) in enumerate(WALK.items()):
        embed[ids[text]] = torch.nn.functional.one_hot(torch.tensor(dim), hidden).float()
        for successor in successors:  # the norm scales a unit vector by sqrt(hidden)
            head[ids[successor], dim] = STEP / hidden**0.5
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, head
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps({**config, "tie_word_embeddings": False, "dtype": "float32"})
    )
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SOURCE / name, folder / name)
    return folder

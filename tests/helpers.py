"""Shared by the tests: where the repository is, a tiny model config, running the recipe as a user would."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import warm
import yaml
from accelerate.utils.other import get_free_port as free_port
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.checkpoint import MARKER, portable
from toolkit.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "finetune_llm.py"
# The DeepSpeed JSON fields the recipe's config decides (the shipped JSONs leave them "auto").
DS_RECIPE_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
)
# Small and quick, but the real demo model, data and code path.
QUICK = [
    "train.max_steps=4",
    "train.log_every_steps=1",
    "train.warmup_steps=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "data.max_length=64",
    "eval.exact_match_samples=0",
    "eval.max_batches=2",
    "eval.max_new_tokens=4",
]


def recipe_command(
    output_dir: Path,
    *overrides: str,
    config: str | None = None,
    launch: list[str] | None = None,
    recipe: Path = RECIPE,
) -> tuple[list[str], dict]:
    """The command line and environment: `python recipe ...`, or `accelerate launch <launch> recipe ...`."""
    args = (["--config", config] if config else []) + [f"output_dir={output_dir}", *QUICK, *overrides]
    head = (
        [sys.executable, "-m", "accelerate.commands.launch", *launch]
        if launch is not None
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONFAULTHANDLER"] = "1"  # a launch that times out prints its stacks (LaunchTimedOut)
    return [*head, str(recipe), *args], env


def run_ftkit_train(
    output_dir: Path, backend: str, *overrides: str, processes: int = 2
) -> subprocess.CompletedProcess:
    """`ftkit train --backend <backend>` on `processes` gloo processes, with the quick settings."""
    _, env = recipe_command(output_dir)
    command = [sys.executable, "-m", "toolkit.commands.cli", "train", "--backend", backend]
    command += ["--gpus", str(processes), f"output_dir={output_dir}", *QUICK, *overrides]
    result = run_launched([*command, "--", "--main_process_port", str(free_port())], env, keep=output_dir)
    if result.returncode != 0:
        raise AssertionError(f"ftkit train failed ({result.returncode}):\n{result.stderr[-6000:]}")
    return result


def console_lines(result: subprocess.CompletedProcess) -> list[str]:
    """What the user saw, one entry per line or progress-bar redraw."""
    text = result.stdout + "\n" + result.stderr
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


def run_recipe(
    output_dir: Path,
    *overrides: str,
    config: str | None = None,
    launch: list[str] | None = None,
    check: bool = True,
    recipe: Path = RECIPE,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """The recipe run to its end (an AssertionError with its output if it fails and `check`); `env`: more
    environment variables for it."""
    command, base_env = recipe_command(output_dir, *overrides, config=config, launch=launch, recipe=recipe)
    result = run_launched(command, {**base_env, **(env or {})}, keep=output_dir)
    if check and result.returncode != 0:
        raise AssertionError(
            f"recipe failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


# What a rank prints when a C++ thread of torch's gloo backend is still running as Python tears down (the
# recipes and test scripts leave without that teardown: toolkit/entry.py `leave`).
TEARDOWN_ABORT = "terminate called without an active exception"
# A launch that runs this long has hung: the slowest launch in the suite takes under 3 minutes.
LAUNCH_TIMEOUT = 600


class LaunchRetried(UserWarning):
    """A launch was run a second time, after it hung or a rank aborted in gloo's teardown: the message holds
    the first try's stacks or stderr. The test report lists each one and its summary counts them
    (tests/conftest.py): a fault a user's run can meet, never to be passed over."""


def run_launched(
    command: list[str],
    env: dict | None = None,
    keep: Path | None = None,
    timeout: int = LAUNCH_TIMEOUT,
    retry: bool = True,
    expire: threading.Event | None = None,
) -> subprocess.CompletedProcess:
    """Run a command; once more, with `keep` (a directory the command writes) put back as it was before,
    if it hung or a rank aborted in gloo's teardown (with `retry`), warning `LaunchRetried` with what the
    first try left. Any other failure stands, and so does a second hang. `expire`: an event that ends the
    try under way as its timeout would, when set (cleared before a second try)."""
    backup = None
    if keep is not None and keep.exists():
        backup = keep.parent / f".{keep.name}.before"
        shutil.copytree(keep, backup)
    try:
        try:
            result = run_command(command, env, timeout, expire)
            fault = result.returncode != 0 and TEARDOWN_ABORT in result.stderr
            first = (
                f"a rank aborted in gloo's teardown, its stderr:\n{result.stderr[-16000:]}" if fault else ""
            )
        except LaunchTimedOut as hung:
            if not retry:
                raise
            first = f"it hung: {hung}"
        if first and retry:
            warnings.warn(LaunchRetried(f"{shlex.join(command)}\nran again after {first}"), stacklevel=2)
            if expire is not None:
                expire.clear()
            if keep is not None:
                shutil.rmtree(keep, ignore_errors=True)
                if backup is not None:
                    shutil.copytree(backup, keep)
            result = run_command(command, env, timeout, expire)
        return result
    finally:
        if backup is not None:
            shutil.rmtree(backup)


def run_command(
    command: list[str], env: dict | None, timeout: int, expire: threading.Event | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run` from the repository root, output captured; a `python script` or `accelerate launch`
    command starts warm (tests/warm.py) unless the test is marked `real_launch` or FTKIT_TEST_LAUNCH=real.
    `expire`: an event that ends it as the timeout would."""
    env = dict(os.environ) if env is None else env
    try:
        if warm.enabled() and warm.warm_argv(command, env) is not None:
            return warm.run(command, env, REPO, timeout, expire)
        if expire is None:
            return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return run_until(command, env, timeout, expire)
    except subprocess.TimeoutExpired as exc:
        raise LaunchTimedOut(exc.cmd, exc.timeout, exc.output, exc.stderr) from None


def run_until(command: list[str], env: dict, timeout: int, expire: threading.Event):
    """`subprocess.run(..., timeout=timeout)`, also ended once `expire` is set: the command killed, its
    output so far in the TimeoutExpired (not waited for: a rank it started may still hold the pipes)."""
    deadline = time.monotonic() + timeout
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                return subprocess.CompletedProcess(
                    command, proc.returncode, warm.decode(out), warm.decode(err)
                )
            except subprocess.TimeoutExpired as exc:
                if expire.is_set() or time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise subprocess.TimeoutExpired(command, timeout, exc.output, exc.stderr) from None


class LaunchTimedOut(subprocess.TimeoutExpired):
    """A launch that ran out of time, shown with the end of its stderr: started warm, the stacks of each of
    its processes at the timeout (tests/warm.py), where PYTHONFAULTHANDLER was set."""

    def __str__(self) -> str:
        text = self.stderr or b""
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        text = re.sub(r"\nExtension modules: [^\n]*", "", text)  # faulthandler's list of loaded modules
        return f"{super().__str__()}; the end of its stderr:\n{text[-16000:]}"


def start_recipe(
    output_dir: Path, *overrides: str, launch: list[str] | None = None, env: dict | None = None
) -> subprocess.Popen:
    """The recipe started in a session of its own (`env`: variables added to the usual ones)."""
    command, base_env = recipe_command(output_dir, *overrides, launch=launch)
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**base_env, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real tmpfs of `size` mounted at `path` (created here) for the block. Mounting needs root: anyone else
    skips with the reason, and root's failed mount fails the test, so a disk-full test never passes unrun."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"root could not mount a tmpfs at {path}: {mounted.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def step_losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]


def train_lines(output_dir: Path) -> list[dict]:
    """The metrics lines of training steps (those with a loss)."""
    return [r for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]


def run_script(script: Path, args: list[str], out: Path, processes: int = 0, config: str = ""):
    """`script args` on one process, or under a shipped accelerate `config` on `processes`; must succeed."""
    head = [sys.executable]
    if config:
        head += ["-m", "accelerate.commands.launch", *launch(config, processes)]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    result = run_launched([*head, str(script), *args], {**os.environ, **env}, keep=out)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def short_grpo_args(out: Path, steps: int, batch: int, micro: int) -> list[str]:
    """The settings every short GRPO test run shares: `steps` steps of `batch` completions in micro-batches of
    `micro`, every step logged at a constant learning rate, no held-out evaluation, no start adapter."""
    return [
        f"output_dir={out}",
        "model.adapter=null",
        f"train.max_steps={steps}",
        "train.log_every_steps=1",
        "train.warmup_steps=0",
        "train.lr_scheduler=constant",
        f"train.global_batch_size={batch}",
        f"train.micro_batch_size={micro}",
        "data.eval=null",
        "eval.exact_match_samples=0",
        "eval.max_batches=0",
    ]


def demo_pair_files(root: Path, train: int, held_out: int) -> Path:
    """`root` holding train.jsonl and eval.jsonl: the first `train` and `held_out` of the demo's pairs."""
    demo = REPO / "toolkit" / "assets" / "demo"
    for name, rows in (("train", train), ("eval", held_out)):
        lines = (demo / f"pairs_{name}.jsonl").read_text().splitlines(True)[:rows]
        (root / f"{name}.jsonl").write_text("".join(lines))
    return root


def pair_run_args(out: Path, pair_files: Path, steps: int) -> list[str]:
    """What the pair recipes' launched tests share: their pair files, no adapter, `steps` steps each logged
    at a constant learning rate, 8 pairs a step in micro-batches of 2."""
    return [
        f"output_dir={out}",
        f"data.train={pair_files / 'train.jsonl'}",
        f"data.eval={pair_files / 'eval.jsonl'}",
        "model.adapter=null",
        f"train.max_steps={steps}",
        "train.log_every_steps=1",
        "train.warmup_steps=0",
        "train.lr_scheduler=constant",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
    ]


def launch(config: str, processes: int = 2) -> list[str]:
    """`accelerate launch` arguments for a shipped config on `processes` local processes."""
    return [
        "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
    ]


def write_yaml(tmp_path: Path, content: dict, name: str = "accel.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content))
    return path


# Tiny random mixtures of experts on the embedded tokenizer: 4 experts a layer, 2 per token.
TINY_MOE = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, head_dim=16),
    "mixtral": dict(num_local_experts=4),
    "gpt_oss": dict(num_local_experts=4, head_dim=16),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "olmoe": dict(num_experts=4),
    "granitemoeshared": dict(num_local_experts=4, shared_intermediate_size=64),
}


def tiny_moe_config(model_type: str = "qwen3_moe", **overrides):
    """A tiny `model_type` mixture of experts' config: 2 layers, hidden 64, the embedded tokenizer's vocab."""
    from transformers import AutoConfig

    shape = dict(
        vocab_size=2048, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    shape.update(num_key_value_heads=2, num_experts_per_tok=2, bos_token_id=0, eos_token_id=2, pad_token_id=3)
    return AutoConfig.for_model(model_type, **{**shape, **TINY_MOE[model_type], **overrides})


def tiny_moe(path: Path, model_type: str = "qwen3_moe", **overrides) -> Path:
    """A random `model_type` mixture of experts saved at `path` with the embedded tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_moe_config(model_type, **overrides)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toolkit" / "assets" / "tiny-llama" / name, path / name)
    return path


def start_adapter(path: Path) -> Path:
    """A LoRA adapter for the embedded model, saved at `path`, whose B matrices are random (not peft's
    zeros): merged in as `model.adapter`, it moves the model, so a start that dropped it would show."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    adapter = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, adapter).save_pretrained(path)
    return path


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A Llama that builds in milliseconds: 2 layers, hidden 32, 4 heads sharing 2 key/value heads."""
    shape = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**shape, **overrides})


def trl_sized_llama(tokenizer, **overrides) -> LlamaConfig:
    """The Llama the TRL-parity tests build on the embedded tokenizer: 2 layers, hidden 32, 2 heads sharing
    one key/value head."""
    shape = dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return tiny_llama_config(vocab_size=len(tokenizer), **{**shape, **overrides})


def policy_and_reference(config: LlamaConfig) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A policy drawn from seed 0 and a reference a little away from it: the log-ratios of a preference
    loss mean something only where the two differ."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def micro_llama(**overrides) -> LlamaForCausalLM:
    """The smallest Llama the loss and reference tests need (1 layer, hidden 16, vocab 64), its weights
    drawn from seed 0 so every call gives the same model."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(tiny_llama_config(**{**shape, **overrides}))


def load_recipe(name: str = "finetune_llm"):
    """A recipe script as a module, so a test can call its `main` in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What the model-parallel tests read back from a finished run.


def final_weights(out) -> dict[str, torch.Tensor]:
    final = out / "final"
    name = "adapter_model.safetensors" if (final / "adapter_config.json").is_file() else "model.safetensors"
    return load_file(final / name)


def assert_same_weights(got: dict, expected: dict) -> None:
    """Relative to each tensor's scale (Adam turns rounding in near-zero gradients into whole steps)."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        scale = tensor.abs().max().clamp_min(1e-12)
        assert ((got[name] - tensor).abs().max() / scale) < 1e-2, name


def assert_export_is_the_trained_state(out) -> None:
    """final/ holds, whole and bit for bit, the weights of the run's last checkpoint (read on one process:
    each stage's layers from its own process's files)."""
    saved = portable.read_weights(out / "checkpoints" / "step-4")
    exported = final_weights(out)
    for name, tensor in exported.items():
        key = re.sub(r"\.(lora_[AB])\.", r".\1.default.", name)
        assert torch.equal(tensor, saved[key]), name


def logged(out, key: str) -> list:
    return [r[key] for r in read_metrics(out / "metrics.jsonl") if key in r]


def marker(out, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step-{step}" / MARKER).read_text())


# A tiny random Qwen2.5-VL on the embedded tokenizer, its processor saved beside it (image processor,
# tokenizer with Qwen's vision tokens, a chat template writing each image as Qwen does).
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_qwen_vl(path: Path) -> Path:
    """A random two-layer Qwen2.5-VL (vision tower: 2 blocks, 14-pixel patches merged 2 x 2) at `path`."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # every projection 64 wide: 4-bit QLoRA runs on CPU at multiples of 64
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    tower = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1],
        window_size=56,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=tower,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    tokenizer.chat_template = QWEN_TEMPLATE
    # Saved part by part: without torchvision the processor cannot save its (absent) video processor.
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
"""Gemma-3's own template in short (no bos, no system folding): an image part is `<start_of_image>`, which
the processor expands into the image's soft tokens."""


SIGLIP_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
)
"""The two-layer SigLIP tower of the tiny Gemma-3 and Idefics3: 56-pixel images in 14-pixel patches."""


def tiny_gemma3(path: Path) -> Path:
    """A random two-layer Gemma-3 (SigLIP tower: 2 layers on 56-pixel images, 14-pixel patches pooled to 4
    soft tokens per image; one sliding and one full attention layer) with its processor at `path`."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(
        REPO / "toolkit" / "assets" / "tiny-llama", extra_special_tokens=GEMMA3_TOKENS
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    tower = {**SIGLIP_TOWER, "vision_use_head": False}
    config = Gemma3Config(
        text_config=text,
        vision_config=tower,
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the projector at zero, which would hide every image from the language model.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    model.save_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = Gemma3Processor(images, tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=4)
    processor.save_pretrained(path)
    return path


IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
]
IDEFICS3_TEMPLATE = (
    "<|im_start|>{%- for message in messages %}{{- message['role'] | capitalize }}"
    "{{- ':' if message['content'][0]['type'] == 'image' else ': ' }}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<image>' }}{%- endif %}{%- endfor %}"
    "{{- '<end_of_utterance>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"
)
"""SmolVLM's template: content as parts only, an image part is `<image>`, expanded by the processor into
each crop's tokens."""


def tiny_idefics3(path: Path) -> Path:
    """A random two-layer Idefics3 (the SmolVLM architecture: a 2-layer tower on 56-pixel crops of
    14-pixel patches, pixel-shuffled 2 x 2 into 4 tokens per crop; an image up to 112 pixels is split
    into 56-pixel crops plus a global one) with its processor at `path`."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    tower = SIGLIP_TOWER
    config = Idefics3Config(
        text_config=text,
        vision_config=tower,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(path)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
    )
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(path)
    return path


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 210, 20)}


def square_image(path: Path, colour: str, side: int = 56) -> Path:
    """A PNG of a `colour` square on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), (255, 255, 255))
    ImageDraw.Draw(image).rectangle(
        [side // 5, side // 5, side * 4 // 5, side * 4 // 5], fill=COLOURS[colour]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def image_layouts(folder: Path, rows: int = 12) -> list[Path]:
    """The same kind of image questions in the four layouts users bring (TRL messages + images, OpenAI
    parts with data URLs, LLaMA-Factory sharegpt with <image>, LLaVA JSON), one file each, images relative
    to the file; every third row holds two images and every fourth is text only."""
    import base64

    names = list(COLOURS)
    files = {"trl.jsonl": [], "openai.jsonl": [], "sharegpt.jsonl": [], "llava.json": []}
    for layout, records in files.items():
        for i in range(rows):
            colours = [names[(i + k) % len(names)] for k in range(2 if i % 3 == 0 else 1)]
            refs = [f"img/{layout.split('.')[0]}-{i}-{k}.png" for k in range(len(colours))]
            for ref, colour in zip(refs, colours):
                square_image(folder / ref, colour)
            question, answer = "What colours are shown?", " and ".join(colours)
            if i % 4 == 3:
                records.append(_text_row(layout, "Say ok.", "ok"))
            elif layout == "trl.jsonl":
                parts = [{"type": "image"} for _ in refs] + [{"type": "text", "text": question}]
                records.append({"messages": _chat(parts, answer), "images": refs})
            elif layout == "openai.jsonl":
                urls = [
                    "data:image/png;base64," + base64.b64encode((folder / ref).read_bytes()).decode()
                    for ref in refs
                ]
                parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
                records.append({"messages": _chat([*parts, {"type": "text", "text": question}], answer)})
            elif layout == "sharegpt.jsonl":
                turns = [{"from": "human", "value": "<image>" * len(refs) + question}]
                records.append({"conversations": [*turns, {"from": "gpt", "value": answer}], "images": refs})
            else:
                turns = [{"from": "human", "value": "<image>\n" * len(refs) + question}]
                image = refs[0] if len(refs) == 1 else refs
                records.append(
                    {
                        "id": str(i),
                        "image": image,
                        "conversations": [*turns, {"from": "gpt", "value": answer}],
                    }
                )
    paths = []
    for name, records in files.items():
        path = folder / name
        if name.endswith(".json"):
            path.write_text(json.dumps(records))
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths


def _chat(user_parts: list, answer: str) -> list[dict]:
    return [{"role": "user", "content": user_parts}, {"role": "assistant", "content": answer}]


def _text_row(layout: str, question: str, answer: str) -> dict:
    if layout in ("trl.jsonl", "openai.jsonl"):
        return {"messages": _chat([{"type": "text", "text": question}], answer)}
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


class OneProcess:
    """What a GRPO round, its scoring and the engine sampler ask of an Accelerator, for one process."""

    process_index, num_processes, device, is_main_process = 0, 1, "cpu", True

    class state:
        device_mesh = None

    def gather(self, tensor):
        return tensor


def trained_runs(talk) -> list[tuple[int, list[int]]]:
    """A conversation as runs of (trained, token ids): the model's turns, the environment's between them."""
    runs = []
    for token, trained in zip(talk.tokens, talk.trained, strict=True):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs

"""TRL's GRPOTrainer on the GRPO benchmark's model and prompts, LoRA, HF generate (no vLLM), its defaults
apart from the settings bench/grpo.py shares with ftkit.

    BENCH_STATS=stats.json python bench/trl_grpo.py MODEL_DIR PROMPTS OUT_DIR STEPS COMPLETIONS G \
        MAX_NEW_TOKENS LEARNING_RATE FORMAT_PATTERN

PROMPTS is a file of chat records (`messages`): everything before the last assistant turn is the prompt,
that turn's text the answer the exact-match reward compares with. COMPLETIONS is the global batch, G
completions for each of COMPLETIONS / G prompts; one generation round feeds one optimizer step. The reward
is ftkit's exact_answer plus its format reward on FORMAT_PATTERN, weights 1 and 1.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers and TRL are imported: nothing is fetched

import json
import re
import sys
import time
from pathlib import Path

from common import SEED, StepStats
from datasets import Dataset
from hf_trainers import SHARED
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1 where the completion, stripped, equals the reference answer (ftkit's built-in exact_answer)."""
    return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]


def format_reward(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def matches_format(completions, **kwargs) -> list[float]:
        """1 where the whole completion, stripped, matches the pattern (ftkit's built-in format reward)."""
        return [float(compiled.fullmatch(c[0]["content"].strip()) is not None) for c in completions]

    return matches_format


class RoundRecorder(TrainerCallback):
    """Stamps the start of the first optimizer step and the end of each, times each generation round (TRL's
    `_generate_and_score_completions`: sampling, rewards, advantages) and keeps each step's logged figures."""

    def __init__(self):
        self.stats = StepStats()
        self.generation_s: list[float] = []
        self.logged: list[dict] = []

    def timed(self, generate_and_score):
        def wrapper(inputs):
            started = time.perf_counter()
            out = generate_and_score(inputs)
            self.generation_s.append(time.perf_counter() - started)
            return out

        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        self.stats.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.step(0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged.append(logs)

    def save(self) -> None:
        record = {
            "first_step_begin": self.stats.first_step_begin,
            "step_end": self.stats.step_end,
            "generation_s": self.generation_s,
            "loss": [x["loss"] for x in self.logged],
            "reward": [x["reward"] for x in self.logged],
            "reward_format": [x["rewards/matches_format/mean"] for x in self.logged],
            "grad_norm": [x["grad_norm"] for x in self.logged],
            "zero_std_frac": [x["frac_reward_zero_std"] for x in self.logged],
            "completion_len": [x["completions/mean_length"] for x in self.logged],
        }
        Path(os.environ["BENCH_STATS"]).write_text(json.dumps(record))


def prompt_records(path: str) -> list[dict]:
    with open(path) as handle:
        chats = [json.loads(line)["messages"] for line in handle]
    return [{"prompt": m[:-1], "answer": m[-1]["content"]} for m in chats]


def main(
    model_dir, prompts_path, out_dir, steps, completions, group, max_new_tokens, learning_rate, pattern
) -> None:
    from trl import GRPOConfig, GRPOTrainer

    set_seed(SEED)  # before the model and its adapter, as ftkit does
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    # The model's generation config also ends at token 0; ftkit's sampling stops at the tokenizer's end
    # token only, so both sample under the same stopping rule.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    shared = {**SHARED, "max_steps": int(steps), "per_device_train_batch_size": int(completions),
              "learning_rate": float(learning_rate)}  # fmt: skip
    config = GRPOConfig(
        output_dir=out_dir,
        num_generations=int(group),
        steps_per_generation=1,
        max_completion_length=int(max_new_tokens),
        temperature=1.0,
        beta=0.0,
        loss_type="grpo",
        # ftkit's advantages: the weighted sum of the rewards, minus its group's mean, over the group's
        # unbiased std + 1e-4 (TRL's defaults in 1.16, stated so that a change of default shows)
        reward_weights=[1.0, 1.0],
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards="group",
        use_vllm=False,
        gradient_checkpointing=False,
        **shared,
    )
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    recorder = RoundRecorder()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer, format_reward(pattern)],
        args=config,
        train_dataset=Dataset.from_list(prompt_records(prompts_path)),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[recorder],
    )
    trainer._generate_and_score_completions = recorder.timed(trainer._generate_and_score_completions)
    trainer.train()
    recorder.save()


if __name__ == "__main__":
    main(*sys.argv[1:10])

"""sentence-transformers' own trainer on the embedding benchmark's model and triplets:
SentenceTransformerTrainer with MultipleNegativesRankingLoss (in-batch and hard negatives, cosine
similarity x 20, i.e. temperature 0.05), the model a Transformer and a mean Pooling module over the same
local folder, the shared optimizer settings.
Writes the step times, real tokens and every step's loss (read from the loss itself, unrounded).

    BENCH_STATS=stats.json python bench/st_embed.py MODEL_DIR TRIPLETS OUT_DIR STEPS BATCH MAX_LENGTH LR
"""

import json
import os
import sys
from pathlib import Path

from common import SEED, StepStats
from datasets import Dataset
from transformers import TrainerCallback, set_seed


class StepClock(TrainerCallback):
    """Stamps the start of the first optimizer step and the end of each."""

    def __init__(self, stats: StepStats, tokens: list[int]):
        self.stats, self.tokens = stats, tokens

    def on_step_begin(self, args, state, control, **kwargs):
        self.stats.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.stats.step(self.tokens[-1])


def main(model_dir: str, triplets: str, out_dir: str, steps: str, batch: str, length: str, lr: str) -> None:
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    set_seed(SEED)
    with open(triplets) as handle:
        records = [json.loads(line) for line in handle]
    # Pinned to plain text: a tokenizer with a chat template would otherwise have every text rendered as a
    # chat message, a different input than ftkit's tokenizer(text) (and than what ftkit's export declares).
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    body = Transformer(
        model_dir, max_seq_length=int(length), modality_config=text, module_output_name="token_embeddings"
    )
    model = SentenceTransformer(modules=[body, Pooling(body.get_embedding_dimension(), "mean")])
    stats, tokens, losses = StepStats(), [], []

    class Recorded(MultipleNegativesRankingLoss):
        """The loss as it is, with each step's value and real tokens noted."""

        def forward(self, sentence_features, labels):
            loss = super().forward(sentence_features, labels)
            tokens.append(sum(int(f["attention_mask"].sum()) for f in sentence_features))
            losses.append(float(loss))
            return loss

    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=int(batch),
        max_steps=int(steps),
        learning_rate=float(lr),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=SEED,
        disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(records),
        loss=Recorded(model, scale=20.0),
        callbacks=[StepClock(stats, tokens)],
    )
    trainer.train()
    stats.loss = losses[-1]
    stats.save()
    path = Path(os.environ["BENCH_STATS"])
    path.write_text(json.dumps({**json.loads(path.read_text()), "losses": losses}))


if __name__ == "__main__":
    main(*sys.argv[1:8])

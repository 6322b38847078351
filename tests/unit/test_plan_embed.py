"""`ftkit plan --objective embed` (and `--config` an embedding config): the model without its LM head, the
sequences a row puts through it, GradCache's stored vectors, and a reranker's or classifier's head; the
numbers against a count by hand (toolkit/plan/embedding.py has the formulas)."""

import pytest

from toolkit.errors import UserError
from toolkit.plan import memory
from toolkit.plan.estimate import make_plan, resolve_precision
from toolkit.plan.from_config import with_config
from toolkit.plan.report import render_text
from toolkit.plan.request import PlanRequest

BERT, LLAMA = "toolkit/assets/tiny-bert", "toolkit/assets/tiny-llama"
DEMO = "recipes/configs/demo-embed.yaml"
# The tiny Llama: hidden 160, 4 heads of 40 (2 kv heads), MLP 640, vocabulary 2048, 4 layers, untied head.
SHAPES = dict(seq_len=32, global_batch=16, micro_batch=8, dtype="float32", mixed_precision="no")


def row(plan, backend="single", ckpt=False):
    return next(r for r in plan.rows if r.backend == backend and r.checkpointing == ckpt)


@pytest.fixture(scope="module")
def demo():
    return make_plan(PlanRequest(**with_config({"config": DEMO})))


def test_an_encoder_is_counted_without_its_masked_lm_head():
    """tiny BERT by hand: embeddings 2048x128 words + 512x128 positions + 2x128 types + a LayerNorm;
    a layer q, k, v, o (128x128 + 128 each), a LayerNorm, 128->512->128 with biases, a LayerNorm; the
    pooler 128x128 + 128. The masked-LM head (a transform and a vocabulary bias) is not there."""
    embeddings = 2048 * 128 + 512 * 128 + 2 * 128 + 2 * 128
    layer = 4 * (128 * 128 + 128) + 2 * 128 + (128 * 512 + 512) + (512 * 128 + 128) + 2 * 128
    plan = make_plan(PlanRequest(BERT, method="full", objective="embed", **SHAPES))
    assert plan.counts.total == embeddings + 4 * layer + 128 * 128 + 128 == 1_137_792
    assert plan.counts.lm_head == 0
    assert make_plan(PlanRequest(BERT, method="full", **SHAPES)).counts.total > plan.counts.total


def test_a_decoder_backbone_and_the_heads_of_a_reranker_and_a_classifier():
    """LoRA r16 on the tiny Llama's 7 linears a layer: 16 x (in + out) each, 56,320 a layer; a reranker's
    head is 160 x 1 (trained beside the adapters, stored twice under peft), a classifier's 160 x 3."""
    adapters = 4 * 16 * (2 * (160 + 160) + 2 * (160 + 80) + 3 * (160 + 640))
    bare = make_plan(PlanRequest(LLAMA, objective="embed", **SHAPES)).counts
    causal = make_plan(PlanRequest(LLAMA, **SHAPES)).counts
    assert bare.trainable == adapters == 225_280
    assert causal.total - bare.total == 2048 * 160  # the LM head, untied
    reranker = make_plan(PlanRequest(LLAMA, objective="embed", embed_task="reranker", **SHAPES)).counts
    assert reranker.trainable == adapters + 160 and reranker.total == bare.total + 2 * 160
    classifier = make_plan(
        PlanRequest(LLAMA, objective="embed", embed_task="classifier", labels=3, **SHAPES)
    ).counts
    assert classifier.trainable == adapters + 3 * 160


def test_the_demo_config_plans_a_cached_step_of_anchor_positive_and_negative(demo):
    """demo-embed.yaml: 16 rows of (anchor, positive, 1 hard negative, read from its data), micro-batch 8
    on one process, so GradCache. Its loss by hand, q = 16 queries, K = 16 x 2 candidates, width 160:
    12 x 160 x (16 + 32) + 12 x 16 x 32 = 98,304 bytes, its Matryoshka size 64 12 x 64 x (16 + 32) +
    12 x 16 x 32 = 43,008 more, and the 48 stored vectors, fp32 (no autocast): 48 x 160 x (4 + 8) = 92,160."""
    r = demo.request
    assert (r.objective, r.embed_task, r.negatives, r.micro_batch, r.seq_len) == (
        "embed",
        "embedding",
        1,
        8,
        32,
    )
    assert r.rows_per_example == 3 and r.head is None and r.matryoshka_dims == (64,)
    assert row(demo).head == 98_304 + 43_008 + 92_160
    text = render_text(demo)
    assert "cached (GradCache): one micro-batch of 8 rows" in text
    assert "width 160 (and Matryoshka 64, each with its own logits)" in text
    whole_width = make_plan(PlanRequest(**with_config({"config": DEMO, "matryoshka_dims": ()})))
    assert row(whole_width).head == 98_304 + 92_160
    assert "recipes/embed_llm.py --config recipes/configs/demo-embed.yaml" in demo.command


def test_one_pass_stores_no_vectors_and_the_activations_are_three_sequences_a_row(demo):
    """At micro-batch 16 (one pass a step) only the loss's 98,304 + 43,008 bytes; each row's 3 sequences
    make the transformer's activations 3 times a causal LM's at the same micro-batch (same layers, same
    width)."""
    one_pass = make_plan(PlanRequest(**with_config({"config": DEMO, "micro_batch": 16})))
    assert row(one_pass).head == 98_304 + 43_008
    precision = resolve_precision(demo.request)
    per_sequence = memory.activation_bytes(demo.counts, 32, 1, False, precision)
    assert row(demo).activations - row(demo).head == 8 * 3 * per_sequence
    cached = make_plan(PlanRequest(**with_config({"config": DEMO, "micro_batch": 16, "cached": True})))
    assert row(cached).head == 98_304 + 43_008 + 92_160


def test_a_classifier_s_scores_and_a_reranker_s_candidates():
    classifier = make_plan(PlanRequest(BERT, objective="embed", embed_task="classifier", labels=3, **SHAPES))
    assert row(classifier).head == 12 * 8 * 3
    reranker = make_plan(PlanRequest(BERT, objective="embed", embed_task="reranker", negatives=3, **SHAPES))
    assert reranker.request.rows_per_example == 4 and row(reranker).head == 12 * 8 * 4


def test_model_parallel_layouts_are_refused_as_the_recipe_refuses_them():
    plan = make_plan(PlanRequest(**with_config({"config": DEMO, "gpus": 2})))
    assert plan.layouts and all(not layout.rows for layout in plan.layouts)
    assert all("refused by the embedding recipe" in layout.refusal for layout in plan.layouts)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(cached=True), "--cached is for --objective embed"),
        (
            dict(objective="embed", embed_task="classifier", cached=True),
            "--cached is for --embed-task embedding",
        ),
        (dict(objective="embed", labels=3), "--labels is for --embed-task classifier"),
        (
            dict(objective="embed", embed_task="reranker", matryoshka_dims=(32,)),
            "--matryoshka-dims is for --embed-task embedding",
        ),
        (dict(objective="embed", embed_task="classifier", negatives=1), "--negatives is for --embed-task"),
        (dict(objective="embed", global_batch=1, micro_batch=1), "no in-batch negative"),
        (dict(objective="embed", reference_model=True), "--reference-model is for --objective dpo or grpo"),
    ],
)
def test_options_for_another_task_are_refused(options, message):
    with pytest.raises(UserError, match=message):
        make_plan(PlanRequest(LLAMA, seq_len=32, **options))


def test_config_takes_the_recipe_s_keys_and_the_flags_given_win():
    options = with_config({"config": "recipes/configs/demo-dpo.yaml", "gpus": 2, "seq_len": 128})
    assert (options["objective"], options["gpus"], options["seq_len"]) == ("dpo", 2, 128)
    assert options["global_batch"] == 16 and options["model"] == LLAMA


def test_config_needs_a_recipe_the_plan_knows_and_a_model():
    with pytest.raises(UserError, match="does not plan the rm recipe"):
        with_config({"config": "recipes/configs/demo-rm.yaml"})
    with pytest.raises(UserError, match="needs --model"):
        with_config({})

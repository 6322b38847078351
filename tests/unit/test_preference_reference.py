"""Reference log-probs: never from a model in train mode (dropout), the adapter really switched off, and
precomputed tables equal to live ones, saved as safetensors + JSON and refused for other data."""

import pytest
import torch
from accelerate import Accelerator
from helpers import micro_llama
from peft import LoraConfig, get_peft_model

from toolkit.errors import UserError
from toolkit.preference import reference
from toolkit.preference.data import PairCollator
from toolkit.preference.loss import sequence_logps


def dataset():
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, (p, c, r) in enumerate([(3, 2, 5), (6, 4, 1), (2, 7, 3), (5, 1, 2), (4, 3, 3)]):
        ids = torch.randint(4, 64, (p + c + r,), generator=gen).tolist()
        rows.append(
            {
                "prompt_ids": ids[:p],
                "chosen_ids": ids[p : p + c],
                "rejected_ids": ids[p + c :],
                "pair_index": i,
            }
        )
    return rows


def eval_logps(model, batch):
    model.eval()
    with torch.no_grad():
        return sequence_logps(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            batch["labels"],
        )[0]


def test_reference_runs_without_dropout_and_restores_train_mode():
    accelerator = Accelerator(cpu=True)
    model = get_peft_model(
        micro_llama(num_hidden_layers=2, attention_dropout=0.5),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    batch = PairCollator(pad_id=0)(dataset())
    model.train()
    first = reference.live_logps(accelerator, model, batch)
    second = reference.live_logps(accelerator, model, batch)
    assert model.training
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    with model.disable_adapter():
        torch.testing.assert_close(first, eval_logps(model, batch))


def test_adapter_is_switched_off_for_the_reference():
    accelerator = Accelerator(cpu=True)
    base = micro_llama(num_hidden_layers=2)
    batch = PairCollator(pad_id=0)(dataset())
    expected = eval_logps(base, batch)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert not torch.allclose(eval_logps(model, batch), expected)  # the adapter changes the outputs
    torch.testing.assert_close(reference.live_logps(accelerator, model, batch), expected)


def test_precomputed_tables_equal_live_values_and_round_trip(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = micro_llama(num_hidden_layers=2)
    rows, collate = dataset(), PairCollator(pad_id=0)
    table = reference.compute(accelerator, model, rows, collate, batch_size=2)
    live = eval_logps(model, collate(rows)).double()
    torch.testing.assert_close(torch.cat([table.chosen, table.rejected]), live, rtol=1e-6, atol=1e-6)
    batch = collate([rows[3], rows[1]])
    torch.testing.assert_close(table.lookup(batch), torch.cat([table.chosen[[3, 1]], table.rejected[[3, 1]]]))
    fingerprint = {"pairs": {"train": 5}}
    reference.save(tmp_path, {"train": table}, fingerprint)
    assert (tmp_path / reference.FILE).is_file() and (tmp_path / reference.INFO).is_file()
    loaded = reference.load(tmp_path, fingerprint)["train"]
    torch.testing.assert_close(loaded.chosen, table.chosen, rtol=0, atol=0)
    with pytest.raises(UserError, match="computed for other data"):
        reference.load(tmp_path, {"pairs": {"train": 6}})
    assert reference.load(tmp_path / "none", fingerprint) is None

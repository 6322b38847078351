"""Where the studio's chat model answers (toolkit/studio/chat_place.py): on the GPU with room for it beside
what runs there, else on the CPU with one line saying why; that line is the answer's first."""

import subprocess
from pathlib import Path

from toolkit.launch.machine import GIB
from toolkit.studio import chat_place
from toolkit.studio.chat import Worker

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "toolkit" / "assets" / "tiny-llama"


def smi(stdout: str, code: int = 0):
    return lambda *args, **kwargs: subprocess.CompletedProcess(args, code, stdout, "")


def test_nvidia_smis_free_memory_is_read_and_a_missing_one_is_no_gpu():
    assert chat_place.free_gpus(smi("0, 1024\n1, 30000\n")) == [(0, 1024 << 20), (1, 30000 << 20)]
    assert chat_place.free_gpus(smi("", 9)) == []

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert chat_place.free_gpus(missing) == []


def test_a_model_goes_where_it_fits_and_says_why_not_on_a_gpu(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    need = int((3 << 20) * chat_place.HEADROOM) + chat_place.WORKSPACE
    assert chat_place.place(model, []) == ("cpu", "")  # no GPU: nothing to say
    assert chat_place.place(model, [(0, need - 1), (1, need)]) == ("cuda:1", "")
    device, line = chat_place.place(model, [(0, need - 1), (1, 10)])
    assert device == "cpu" and line == (
        f"chat: {model} needs about {need / GIB:.1f} GiB on a GPU and the most any GPU has free beside what "
        f"runs there is {(need - 1) / GIB:.1f} GiB (GPU 0): it answers on the CPU, slower"
    )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    (adapter / "adapter_config.json").write_text(f'{{"base_model_name_or_path": "{model}"}}')
    assert chat_place.weights_bytes(adapter) == (3 << 20) + 100  # an adapter needs its base too


def test_the_line_is_the_first_thing_the_chat_answers():
    worker = Worker(TINY, gpus=[(0, 1 << 20)])  # a GPU with 1 MiB free: the CPU answers
    try:
        pieces = list(worker.ask("What is 38 + 47?", 4))
    finally:
        worker.close()
    assert worker.device == "cpu" and pieces[0].startswith(f"[chat: {TINY} needs about ")
    assert pieces[0].endswith("it answers on the CPU, slower]\n") and len(pieces) > 1

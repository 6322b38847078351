"""`ftkit doctor`: findings for described machines (probes as data), and one real run here."""

import dataclasses
import json

import pytest

from toolkit.commands import cli
from toolkit.commands.doctor.records import Gpu, Probes
from toolkit.commands.doctor.report import diagnose, exit_code, render_text, to_json
from toolkit.launch.machine import GIB

RTX_4090 = Gpu("NVIDIA GeForce RTX 4090", 24 * GIB)
A100 = Gpu("NVIDIA A100-SXM4-80GB", 80 * GIB)


def machine(**changes) -> Probes:
    """A healthy 2 x A100 NVLink box; each test changes what it is about."""
    healthy = Probes(
        python="3.11.7",
        packages={
            "torch": "2.6.0",
            "accelerate": "1.4.0",
            "transformers": "4.51.0",
            "peft": "0.15.0",
            "datasets": "3.0.0",
            "deepspeed": "0.16.4",
            "bitsandbytes": "0.45.0",
            "matplotlib": "3.9.0",
            "flash-linear-attention": "0.4.1",
            "causal-conv1d": "1.5.2",
            "mamba-ssm": "2.2.5",
        },
        requirements={"torch": ">=2.4", "accelerate": ">=1.4", "transformers": ">=4.51", "peft": ">=0.15"},
        torch_cuda="12.4",
        nccl="2.21.5",
        driver="550.54.15",
        gpus=[A100, A100],
        p2p=[(0, 1, True), (1, 0, True)],
        topology="GPU0\tX\tNV12\nGPU1\tNV12\tX",
        nccl_env={},
        cpu_cores=32,
        ram_bytes=256 * GIB,
        output_dir="runs",
        disk_free_bytes=500 * GIB,
        accelerate_config_path="/home/me/.cache/huggingface/accelerate/default_config.yaml",
        accelerate_config=None,
        deepspeed_ops={"cpu_adam": True, "fused_adam": True},
        build_tools={"ninja": "/usr/bin/ninja", "c++": "/usr/bin/c++"},
    )
    return dataclasses.replace(healthy, **changes)


def finding(probes: Probes, check: str):
    matches = [f for f in diagnose(probes) if f.check == check]
    assert len(matches) == 1, [f.check for f in diagnose(probes)]
    return matches[0]


def test_healthy_machine_is_all_ok():
    findings = diagnose(machine())
    assert {f.status for f in findings} == {"ok"}
    assert finding(machine(), "p2p").message.endswith("NVLink")
    assert exit_code(findings) == 0


def test_two_4090s_without_p2p_and_no_nccl_settings_warn_with_the_fix():
    box = machine(gpus=[RTX_4090, RTX_4090], p2p=[(0, 1, False), (1, 0, False)], topology=None)
    p2p = finding(box, "p2p")
    assert p2p.status == "warn"
    assert p2p.fix == "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1"
    assert exit_code(diagnose(box)) == 0


def test_4090s_whose_driver_claims_p2p_fail():
    box = machine(gpus=[RTX_4090, RTX_4090], p2p=[(0, 1, True), (1, 0, True)])
    assert finding(box, "p2p").status == "fail"
    assert exit_code(diagnose(box)) == 1


def test_4090s_with_nccl_settings_are_ok():
    box = machine(
        gpus=[RTX_4090, RTX_4090],
        p2p=[(0, 1, False), (1, 0, False)],
        nccl_env={"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
    )
    assert finding(box, "p2p").status == "ok"
    assert "NCCL_P2P_DISABLE=1" in finding(box, "nccl env").message
    half = dataclasses.replace(box, nccl_env={"NCCL_P2P_DISABLE": "1"})
    assert finding(half, "p2p").status == "warn"


def test_p2p_disabled_on_nvlink_is_a_warning():
    assert finding(machine(nccl_env={"NCCL_P2P_DISABLE": "1"}), "nccl env").status == "warn"


def test_cpu_only_machine_says_dry_run():
    box = machine(gpus=[], p2p=[], topology=None, torch_cuda=None, nccl=None, driver=None)
    gpus = finding(box, "gpus")
    assert gpus.status == "warn" and "CPU dry run" in gpus.message
    assert "accelerate launch --config_file accelerate_configs/<x>.yaml" in gpus.message
    assert not [f for f in diagnose(box) if f.check in ("cuda", "p2p", "bitsandbytes")]
    assert exit_code(diagnose(box)) == 0


def test_cpu_torch_on_a_gpu_machine_fails():
    box = machine(gpus=[], p2p=[], torch_cuda=None)
    assert finding(box, "cuda").status == "fail"


def test_mismatched_gpus_warn():
    box = machine(gpus=[A100, Gpu("NVIDIA A100-PCIE-40GB", 40 * GIB)])
    assert finding(box, "gpus").status == "warn" and "CUDA_VISIBLE_DEVICES" in finding(box, "gpus").fix


def test_low_ram_and_few_cores_per_gpu_warn():
    box = machine(ram_bytes=24 * GIB, cpu_cores=2)
    assert finding(box, "ram").status == "warn" and "12.0 GiB per GPU" in finding(box, "ram").message
    assert finding(box, "cpu").status == "warn"


def test_disk_thresholds():
    assert finding(machine(disk_free_bytes=2 * GIB), "disk").status == "fail"
    assert finding(machine(disk_free_bytes=20 * GIB), "disk").status == "warn"


def test_missing_or_old_packages():
    box = machine(packages={**machine().packages, "peft": None, "torch": "2.1.0", "deepspeed": None})
    assert finding(box, "peft").status == "fail"
    assert finding(box, "torch").status == "fail" and finding(box, "torch").fix == "pip install 'torch>=2.4'"
    assert finding(box, "deepspeed").status == "warn"
    assert exit_code(diagnose(box)) == 1


def test_deepspeed_without_build_tools_warns():
    box = machine(build_tools={"ninja": None, "c++": "/usr/bin/c++"})
    assert finding(box, "deepspeed").status == "warn" and "ninja" in finding(box, "deepspeed").message


@pytest.mark.parametrize(
    "config, status",
    [
        (None, "ok"),
        ({"distributed_type": "MULTI_GPU", "num_processes": 2, "mixed_precision": "bf16"}, "ok"),
        ({"distributed_type": "MULTI_GPU", "num_processes": 8}, "warn"),
        ({"error": "bad YAML"}, "warn"),
    ],
)
def test_default_accelerate_config(config, status):
    assert finding(machine(accelerate_config=config), "accelerate").status == status


def test_text_and_json_reports():
    box = machine(gpus=[RTX_4090, RTX_4090], p2p=[(0, 1, True), (1, 0, True)])
    findings = diagnose(box)
    text = render_text(findings, box)
    assert "fix: export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1" in text and "nvidia-smi topo -m:" in text
    report = json.loads(json.dumps(to_json(findings, box)))
    assert report["ok"] is False and report["probes"]["gpus"][0]["name"] == RTX_4090.name


def test_real_run_on_this_machine(capsys, tmp_path):
    code = cli.main(["doctor", "--json", "--output-dir", str(tmp_path / "runs")])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["ok"] else 1)
    checks = {f["check"]: f for f in report["findings"]}
    assert {"versions", "gpus", "cpu", "ram", "disk", "accelerate"} <= set(checks)
    if not report["probes"]["gpus"]:
        assert "CPU dry run" in checks["gpus"]["message"]


def test_bitsandbytes_backend_is_reported_and_a_gpu_without_its_library_warns():
    cpu = finding(machine(bnb_backend="CPU, native library loaded, AVX512-BF16 yes"), "bitsandbytes")
    assert (
        cpu.status == "ok"
        and cpu.message == "bitsandbytes 4-bit backend: CPU, native library loaded, AVX512-BF16 yes"
    )
    broken = finding(machine(bnb_backend="CUDA, native library missing"), "bitsandbytes")
    assert broken.status == "warn" and "pip install 'ftkit[qlora]'" in broken.fix


def test_this_machines_bitsandbytes_backend_is_probed():
    from toolkit.commands.doctor.probe import _bnb_backend

    assert _bnb_backend().startswith(("CPU, native library", "CUDA, native library"))


def test_the_fail_level_probes_of_ftkit_train_skip_the_warn_only_ones(tmp_path):
    """`ftkit train` looks only for failures before it launches: bitsandbytes' import (about 3 s) and
    DeepSpeed's op probe only ever warn, so they are left to `ftkit doctor`."""
    from toolkit.commands.doctor.probe import gather_probes

    quick = gather_probes(tmp_path, include_warnings=False)
    assert quick.bnb_backend is None and quick.deepspeed_ops == {}
    assert quick.packages["torch"] and quick.cpu_cores >= 1


def test_recurrent_kernels_are_reported_per_layer_kind_on_a_gpu_machine():
    ok = finding(machine(), "recurrent kernels")
    assert (
        ok.status == "ok"
        and "gated DeltaNet: flash-linear-attention 0.4.1, causal-conv1d 1.5.2" in ok.message
    )
    packages = {**machine().packages, "mamba-ssm": None, "causal-conv1d": None}
    lacking = finding(machine(packages=packages), "recurrent kernels")
    assert lacking.status == "warn" and "Mamba-2: mamba-ssm missing, causal-conv1d missing" in lacking.message
    assert (
        lacking.fix
        == "make install-gpu-kernels (builds causal-conv1d and mamba-ssm), where those families train"
    )
    packages = {**packages, "flash-linear-attention": None}
    fix = finding(machine(packages=packages), "recurrent kernels").fix
    assert fix.startswith(
        "pip install flash-linear-attention; make install-gpu-kernels (builds causal-conv1d"
    )
    assert not [
        f for f in diagnose(machine(gpus=[], p2p=[], torch_cuda=None)) if f.check == "recurrent kernels"
    ]

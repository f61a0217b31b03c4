#!/usr/bin/env bash
# The CUDA check, run as is on a box with a GPU: the device tests (`pytest -m gpu`, tests/test_gpu.py), then one
# table: greedy tokens through 2 GPU servers = transformers on the same GPU (float32); teacher-forced per-token logits
# of bfloat16/float16/float32 servers within swarmclient/logit_check.py's tolerance of transformers in the same dtype
# (the worst relative error, at most 2x transformers' own error in that dtype vs float32, and per position);
# int8/nf4 servers answer; and tok/s of 64 requests through the swarm vs local generate b64.
#
# It installs nothing: it runs this checkout from PYTHONPATH with the Python found as $PYTHON (default: .venv's
# after scripts/setup.sh, else python3). Checked to use no API newer than Python 3.12, torch 2.11 and
# transformers 5.17 (what a preinstalled CUDA box may have).
#
# A box that can download nothing: on a machine with the same Python and platform, fetch the missing wheels,
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \
#       hivemind==1.1.12 base58 py-multihash py-cid varint netaddr configargparse prefetch_generator \
#       grpcio-tools psutil tenacity pydantic-settings bitsandbytes    # ~10 MB without bitsandbytes
# copy wheels/ over, then: $PYTHON -m pip install --no-index --find-links wheels --no-deps wheels/*.whl
# (the preflight below names what is still missing). Without bitsandbytes the int8/nf4 rows fail, the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

echo "== preflight ($PYTHON)"
"$PYTHON" - <<'PY' || exit 2
import importlib, sys
missing = []
for name in ["torch", "transformers", "safetensors", "tokenizers", "hivemind", "msgpack", "uvloop", "typer",
             "pydantic", "pydantic_settings", "psutil", "tenacity", "pytest", "bitsandbytes"]:
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
if any(m.split()[0] in ("torch", "transformers") for m in missing):
    sys.exit("torch and transformers must be installed: " + "; ".join(missing))
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"CUDA {torch.cuda.is_available() and torch.cuda.get_device_name(0)}")
if missing:
    print("missing: " + "; ".join(missing) + "  (see the top of scripts/gpu-check.sh: carrying wheels)")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU: nothing to check here (every gpu test would skip)")
if any(m.split()[0] not in ("bitsandbytes",) for m in missing):
    sys.exit(1)
PY

REPORT=$(mktemp -t gpu-check.XXXXXX.jsonl)
echo "== pytest -m gpu"
SWARMBATCH_GPU_REPORT="$REPORT" "$PYTHON" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rs -o addopts="" "$@"
status=$?

echo
"$PYTHON" - "$REPORT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
width = max([len(r["check"]) for r in rows] + [5])
print(f"| {'check':{width}} | ok   | detail")
print(f"|{'-' * (width + 2)}|------|-------")
for r in rows:
    print(f"| {r['check']:{width}} | {'yes' if r['ok'] else 'NO ':4} | {r['detail']}")
if not rows:
    print("(no check reported: see pytest's output above)")
PY
rm -f "$REPORT"
exit $status

#!/usr/bin/env bash
# The GPU figures that the open issues still wait for, in one call on a lent GPU machine, most wanted first
# (session 33's run, BENCHMARKS.md, says what the last one found):
#   issue 35: the Triton INT4 kernel at its new defaults against fp16 F.linear at batch 1 (goal >= 2.5x), then
#             the launch sweep, its untimed pipelined loops (num_stages 3, 2, 4) and split walks first;
#   issue 32: notebooks 05 and 04 whole on the GPU (each stopped by too short a limit last time), the
#             Llama-3.2-1B shape's "compiled + graph" row (untimed) and naive loop (cached against naive at
#             1,024 tokens, goal >= 10x), then the notebooks that have never run on one (07, 00, 02, 03) and
#             the other INT4 sweeps.
# Each step has a time limit (what it took on an H100 with a margin, where it has run there) and its own log; a
# step that would not fit in what is left of TOTAL seconds is skipped and says so, and the steps after it still
# run. On the machine (the device tool's run, carrying .whl), TOTAL a little under the call's limit, which is
# less than its timeout_s when little device time is left:
#     TOTAL=575 bash benchmarks/gpu_session.sh
# One call rarely holds them all: a second call (on the warm machine) names the steps it wants, in the order
# they come here:
#     TOTAL=575 STEPS="compile_1b notebook_07 notebook_00" bash benchmarks/gpu_session.sh
# Here first, once a session (the device image lacks Jupyter's kernel packages; they travel as wheels):
#     bash benchmarks/gpu_session.sh wheels
# It prints what would travel: the tree and the wheels must fit in the device tool's 64 MiB.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD

if [ "${1:-}" = wheels ]; then  # Python 3.12 wheels of what the notebooks need and the device image lacks
  version() { .venv/bin/python -m pip show "$1" | awk '/^Version/ {print $2}'; }
  grep -qxs '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir .whl
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    "ipykernel==$(version ipykernel)" "jupyter_client==$(version jupyter_client)" "nbformat==$(version nbformat)" \
    "ipywidgets==$(version ipywidgets)" "plotly==$(version plotly)" "anywidget==$(version anywidget)" || exit
  for present in attrs narwhals packaging psutil pygments python_dateutil typing_extensions; do
    rm -f .whl/"$present"-*.whl  # the image has these: two versions of one package would stop the install
  done
  for optional in debugpy jedi parso widgetsnbextension; do  # a kernel runs without them (debugger, completion,
    rm -f .whl/"$optional"-*.whl                             # the classic notebook's front end); the tree and
  done                                                       # the wheels must travel in 64 MiB
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2> /dev/null | tail -n 1 | cut -f 1)
  wheels=$(du -cb .whl | tail -n 1 | cut -f 1)
  awk -v t="$tree" -v w="$wheels" 'BEGIN {printf "to travel: %.1f MiB (%.1f of the tree, %.1f of wheels); the limit is 64 MiB\n",
                                          (t + w) / 2^20, t / 2^20, w / 2^20}'
  if (( tree + wheels > 64 << 20 )); then  # notebook 02, which the steps run, needs mha, gqa and mqa's
    echo "over it: for the call, move away (and back after) the checkpoints of notebook 11, which the steps do not run:"
    du -sh labkit/checkpoints/{early-exit,medusa}
  fi
  exit
fi

TOTAL=${TOTAL:-570}
OUT=${OUT:-/tmp/gpu_session}
LOGS=/tmp/gpu_session_logs  # packed into $OUT/logs.tgz after each step: the device returns at most 8 files
rm -rf "$LOGS" && mkdir -p "$OUT" "$LOGS"  # a warm machine's second call: this call's logs alone
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  python3 -m ipykernel install --user --name labkit > /dev/null  # the kernel the solutions ask for
fi

step() {  # step NAME LIMIT_S COMMAND...: run it with its log in $LOGS/NAME.log, unless it would pass TOTAL
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    return  # not among the STEPS named
  fi
  if (( SECONDS + limit + 15 > TOTAL )); then  # 15: what timeout -k gives a step after its INT
    echo "== $name: skipped ($limit s would pass the $TOTAL s of this call, $SECONDS s gone)"
    return
  fi
  echo "== $name (at most $limit s): $*"
  timeout -s INT -k 15 "$limit" "$@" > "$LOGS/$name.log" 2>&1  # INT: Python's finally blocks run
  echo "   exit $? after $(( SECONDS - started )) s; its last lines:"
  tail -n 25 "$LOGS/$name.log" | sed 's/^/   /'
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
}
IN_BENCHMARKS="import sys; sys.path.insert(0, 'benchmarks')"
NOTEBOOK=(python3 benchmarks/notebooks_under_load.py --busy 0 --keep-going --out "$LOGS")

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,driver_version --format=csv | tee "$LOGS/gpu.csv"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOGS/gpu.csv"
step int4_layer 60 python3 -c "$IN_BENCHMARKS; from quantization import gpu_layer; gpu_layer(30)"
step int4_sweep 120 python3 benchmarks/int4_gpu_sweep.py --shapes 4096x11008 --budget 90
step notebook_05 170 "${NOTEBOOK[@]}" solutions/05_speculative_decoding.ipynb
step notebook_04 230 "${NOTEBOOK[@]}" solutions/04_continuous_batching.ipynb
step compile_1b 300 python3 benchmarks/compile.py --models draft --skip-cold --repeats 20 --shape Llama-3.2-1B
step notebook_07 60 "${NOTEBOOK[@]}" solutions/07_triton_attention.ipynb
step notebook_00 45 "${NOTEBOOK[@]}" solutions/00_welcome.ipynb
step notebook_02 60 "${NOTEBOOK[@]}" solutions/02_kv_memory.ipynb
step notebook_03 45 "${NOTEBOOK[@]}" solutions/03_paged_attention.ipynb
step int4_sweep_down 50 python3 benchmarks/int4_gpu_sweep.py --shapes 11008x4096 --budget 30
step int4_sweep_bf16 50 python3 benchmarks/int4_gpu_sweep.py --shapes 4096x11008 --budget 30 --dtype bf16
echo "== done after $SECONDS s; logs in $OUT/logs.tgz"

#!/usr/bin/env bash
# Every GPU figure that the open issues wait for, in one call on a lent GPU machine, most wanted first:
#   issue 35: the Triton INT4 kernel against fp16 F.linear at batch 1 (goal >= 2.5x), then its launch sweeps;
#   issue 32: graphed decode on a Llama-3.2-1B shape against the datasheet bandwidth (goal >= 70%) and cached
#             against naive generation at 1,024 tokens (goal >= 10x); notebooks 08, 05, 04 and 06b on the GPU;
#             a Llama-3.1-8B shape, where the weights, not the launches, should set a step's time.
# Each step has a time limit and its own log; a step that would not fit in what is left of TOTAL seconds
# is skipped and says so. On the machine (the device tool's run, carrying .whl), TOTAL a little under the
# call's limit, which is less than its timeout_s when little device time is left:
#     TOTAL=540 bash benchmarks/gpu_session.sh
# Here first, once a session (the device image lacks Jupyter's kernel packages; they travel as wheels):
#     bash benchmarks/gpu_session.sh wheels
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
  du -sh .whl
  exit
fi

TOTAL=${TOTAL:-570}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  python3 -m ipykernel install --user --name labkit > /dev/null  # the kernel the solutions ask for
fi

step() {  # step NAME LIMIT_S COMMAND...: run it with its log in $OUT/NAME.log, unless it would pass TOTAL
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  if (( SECONDS + limit + 15 > TOTAL )); then  # 15: what timeout -k gives a step after its INT
    echo "== $name: skipped ($limit s would pass the $TOTAL s of this call, $SECONDS s gone)"
    return
  fi
  echo "== $name (at most $limit s): $*"
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1  # INT: Python's finally blocks run
  echo "   exit $? after $(( SECONDS - started )) s; its last lines:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   /'
}
IN_BENCHMARKS="import sys; sys.path.insert(0, 'benchmarks')"
NOTEBOOK=(python3 benchmarks/notebooks_under_load.py --busy 0 --keep-going --out "$OUT")

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,driver_version --format=csv | tee "$OUT/gpu.csv"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.csv"
step int4_layer 90 python3 -c "$IN_BENCHMARKS; from quantization import gpu_layer; gpu_layer(30)"
step compile_1b 150 python3 benchmarks/compile.py --models draft --skip-cold --repeats 20 --shape Llama-3.2-1B
step int4_sweep 130 python3 benchmarks/int4_gpu_sweep.py --shapes 4096x11008 --budget 100
step notebook_08 90 "${NOTEBOOK[@]}" solutions/08_compilation.ipynb
step notebook_05 60 "${NOTEBOOK[@]}" solutions/05_speculative_decoding.ipynb
step notebook_04 60 "${NOTEBOOK[@]}" solutions/04_continuous_batching.ipynb
step notebook_06b 70 "${NOTEBOOK[@]}" solutions/06b_fast_quantized_decode.ipynb
step int4_sweep_bf16 50 python3 benchmarks/int4_gpu_sweep.py --shapes 4096x11008 --budget 30 --dtype bf16
step int4_sweep_down 50 python3 benchmarks/int4_gpu_sweep.py --shapes 11008x4096 --budget 30
step decode_8b 90 python3 -c "$IN_BENCHMARKS; from compile import gpu_scale; gpu_scale('Llama-3.1-8B', 256, 20, False)"
echo "== done after $SECONDS s; logs in $OUT"

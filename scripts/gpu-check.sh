#!/usr/bin/env bash
# The GPU check: a baked project's gpu tests and a short benchmark against a bare DDP loop, on a GPU machine that
# reaches no network. Two halves, and a dry run of both:
#
#   scripts/gpu-check.sh --prepare DIR   here, with network: bake the project into DIR/project, copy this script
#                                        and the benchmark into DIR, download the wheels the GPU side lacks
#   DIR/gpu-check.sh --run DIR           on the GPU machine, after copying DIR there: a venv over the python3 that
#                                        holds a CUDA build of torch, the project installed from DIR alone (which
#                                        checks the torch>= floor it declares against that torch), pytest -m gpu,
#                                        the benchmark; then one summary table, also in DIR/results/summary.md.
#                                        It is held to 8 minutes: pytest stops at 5, the benchmark fits the rest.
#   scripts/gpu-check.sh --cpu [DIR]     the dry run, here: --prepare without downloads, then --run on CPU, where
#                                        the gpu tests skip and the benchmark runs tiny. It tests the plumbing only.
#
# Environment: PYTHON, the interpreter of the run half (default python3; with --cpu, the template's environment);
# GPU_PYTHON_VERSION, the Python version of the GPU machine, for the wheels (default 3.12).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
RUN_LIMIT_S=480   # the whole run half
TEST_LIMIT_S=300  # pytest -m gpu, within it

die() {
    echo "gpu-check: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

prepare() {  # DIR, then "download" or "no-download"
    local dir=$1 download=$2 root python
    root=$(cd "$here/.." && pwd)
    [ -f "$root/cookiecutter.json" ] || die "--prepare and --cpu run from the template's scripts/ folder, and $root" \
        "is no template"
    python=$("$root/scripts/setup-env.sh")
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    rm -rf "$dir/project" "$dir/bench" "$dir/wheels" "$dir/results" "$dir/venv"
    # Without wandb: the GPU machine does not have it, the project imports it only when a run uses it, and the gpu
    # tests run with --wandb disabled. That leaves two wheels to carry.
    "$python" -m cookiecutter --no-input --overwrite-if-exists "$root" -o "$dir/project" use_wandb=no >/dev/null
    mkdir -p "$dir/bench" "$dir/wheels"
    cp "$root"/bench/{common,probe,bare_ddp_cuda,gpu_bench}.py "$dir/bench/"
    cp "$root/scripts/gpu-check.sh" "$dir/gpu-check.sh"
    if [ "$download" = download ]; then
        # What the project needs beyond the GPU machine's packages (debugpy, at the version the template tests),
        # and a build backend for installing it there.
        "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir/wheels" \
            "$(grep -E '^debugpy==' "$root/requirements-dev.txt")" "setuptools>=64" \
            2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
            || die "downloading the wheels into $dir/wheels failed (is there a network here?)"
        echo "prepared $dir ($(du -sh "$dir" | cut -f1)); copy it to the GPU machine and run there:"
        echo "    <that copy>/gpu-check.sh --run <that copy>"
    fi
}

run_half() {  # DIR, device (cuda or cpu), python
    local dir=$1 device=$2 python=$3 started project results venv_python site install tests_exit
    started=$(date +%s)
    [ -d "$dir/project" ] && [ -f "$dir/bench/gpu_bench.py" ] \
        || die "$dir is not a prepared folder: run --prepare $dir first"
    dir=$(cd "$dir" && pwd)
    command -v "$python" >/dev/null || die "no interpreter $python: set PYTHON to the python that holds torch"
    "$python" -c 'import torch' 2>/dev/null || die "$python cannot import torch: set PYTHON to the python that holds it"
    if [ "$device" = cuda ]; then
        "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
            || die "$python sees no CUDA GPU (its torch is $("$python" -c 'import torch; print(torch.__version__)'));" \
                "--cpu is the dry run"
    fi
    project=$(find "$dir/project" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    results=$dir/results
    rm -rf "$results" "$dir/venv"
    mkdir -p "$results"

    # A venv over the interpreter that holds CUDA torch. --system-site-packages reaches only the packages of the base
    # installation; when that interpreter is itself a venv (as python3 is on the GPU machine), a .pth file adds its own.
    "$python" -m venv --without-pip --system-site-packages "$dir/venv"
    venv_python=$dir/venv/bin/python
    site=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$python" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_torch_interpreter.pth"
    "$venv_python" -m pip --version >/dev/null 2>&1 || die "$python has no pip to install the project with"

    # The project, installed from DIR alone: pip resolves torch>= and every other requirement against what is there.
    install=ok
    {
        "$venv_python" -m pip install --no-index --find-links "$dir/wheels" --no-cache-dir --disable-pip-version-check \
            "setuptools>=64" &&
        "$venv_python" -m pip install --no-index --find-links "$dir/wheels" --no-cache-dir --disable-pip-version-check \
            --no-build-isolation "$project"
    } > "$results/install.log" 2>&1 || install=failed
    if [ "$install" = ok ]; then
        echo "installed $(basename "$project") from $dir with no network"
    else
        tail -n 20 "$results/install.log" >&2
        echo "gpu-check: installing the project failed (log: $results/install.log); testing it in place" >&2
    fi

    # SIGINT at the limit: pytest stops and each test's subprocess.run kills the training job it started.
    set +e
    (cd "$project" && PYTHONUNBUFFERED=1 timeout -s INT -k 30 "$TEST_LIMIT_S" "$venv_python" -m pytest -m gpu -q -rs \
        -p no:cacheprovider --junitxml "$results/gpu-tests.xml") 2>&1 | tee "$results/pytest.log"
    tests_exit=${PIPESTATUS[0]}
    set -e

    local bench=(--project "$project" --device "$device" --out "$results" --tests-xml "$results/gpu-tests.xml"
                 --tests-exit "$tests_exit" --install "$install" --started "$started" --limit "$RUN_LIMIT_S")
    if [ "$device" = cpu ]; then
        bench+=(--quick)
    fi
    PYTHONUNBUFFERED=1 "$venv_python" "$dir/bench/gpu_bench.py" "${bench[@]}"
}

case "${1:-}" in
    --prepare)
        [ $# -eq 2 ] || die "--prepare needs one folder: scripts/gpu-check.sh --prepare DIR"
        prepare "$2" download
        ;;
    --run)
        [ $# -eq 2 ] || die "--run needs the prepared folder: gpu-check.sh --run DIR"
        run_half "$2" cuda "${PYTHON:-python3}"
        ;;
    --cpu)
        [ $# -le 2 ] || die "--cpu takes at most one folder: scripts/gpu-check.sh --cpu [DIR]"
        dir=${2:-$(mktemp -d -t gpu-check-XXXXXX)}
        prepare "$dir" no-download
        run_half "$dir" cpu "${PYTHON:-$("$here/setup-env.sh")}"
        ;;
    -h | --help)
        usage
        ;;
    *)
        die "unknown argument '${1:-}': use --prepare DIR, --run DIR or --cpu [DIR] (--help says more)"
        ;;
esac

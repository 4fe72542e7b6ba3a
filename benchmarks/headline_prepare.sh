#!/usr/bin/env bash
# Here, with the package registries: everything the headline run carries to the GPU machine (no
# network there), with its size. Run from the repository root:
#   bash benchmarks/headline_prepare.sh
# .whl/   the wheels the machine lacks (snakemake and its plugins' interfaces, lm_eval, datasets,
#         evaluate, aqlm, gguf and their pure-Python needs), versions from envs/requirements.txt
# .whl2/  transformers and tokenizers as envs/ pins them (the machine's transformers 5.17 imports
#         torch.distributed.fsdp in every process that loads a model: 5.9 s, benchmarks/results/README.md)
# .device-carry/headline/  the kit's inputs (python -m benchmarks.headline_kit carry): tokenizer,
#         registry text, the zero-shot tasks
# .whl3/  PuLP, for Snakemake's default (ILP) scheduler: only the -j1 run needs it
# .whl4/  huggingface_hub as envs/ pins it, with httpx2, httpcore2 and truststore
# `gpu_pipeline.sh pack` turns .whl, .whl2 and .whl4 into one 20 MB xz site (.whlx/), which goes
# in one call with .device-carry/headline (or the text of `gpu_pipeline.sh assets`, 12.5 MB).
# The folders are ignored by git
# (.git/info/exclude of the main checkout; .device-carry/ by .gitignore).
# PYTHON: a python3 with the pinned packages (the carry step runs the pipeline's own fetchers).
set -euo pipefail
PY=${PYTHON:-python3}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
for pattern in /.whl/ /.whl2/ /.whl3/ /.whl4/ /.whlx/; do grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"; done

# runtime packages missing on the machine (its package list: the device notes), pure-Python needs included
WHL=(snakemake snakemake-interface-common snakemake-interface-executor-plugins snakemake-interface-logger-plugins
     snakemake-interface-report-plugins snakemake-interface-scheduler-plugins snakemake-interface-storage-plugins
     ConfigArgParse connection_pool conda-inject docutils dpath GitPython gitdb smmap humanfriendly immutables
     jsonschema jsonschema-specifications referencing rpds-py nbformat fastjsonschema jupyter_core traitlets
     platformdirs smart_open throttler yte argparse-dataclass sqlmodel SQLAlchemy greenlet pydantic pydantic_core
     annotated-types typing-inspection tenacity
     lm_eval datasets evaluate dill multiprocess pytablewriter DataProperty mbstrdecoder pathvalidate tabledata
     tcolorpy typepy chardet nltk defusedxml more-itertools pytz
     aqlm gguf)
# published as source only (pure Python): built into wheels here
BUILT=(connection_pool rouge_score sqlitedict word2number)
WHL2=(transformers tokenizers)
# huggingface_hub as envs/ pins it (transformers 5.23 needs it) and the HTTP client it imports, which
# the machine lacks (on 2026-11-28 a site packed without them failed at `import transformers`)
WHL4=(huggingface_hub httpx2 httpcore2 truststore)
# Snakemake's ILP job selection (its default scheduler; without PuLP it falls back to greedy, with a
# warning): only the -j1 run, a user's own command line, needs it
WHL3=(PuLP)

pin() {
  local found
  found=$(grep -iE "^${1//[-_.]/[-_.]}==" envs/requirements.txt | head -1)
  [ -n "$found" ] || { echo "no pin for $1 in envs/requirements.txt" >&2; exit 1; }
  echo "$found"
}
download() {  # folder, names...
  local folder=$1; shift
  mkdir -p "$folder"
  for name in "$@"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$folder" "$(pin "$name")" 2>&1 | grep -v "^WARNING: Location" || true
  done
}
download .whl "${WHL[@]}"
for name in "${BUILT[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w .whl "$(pin "$name")" 2>&1 | grep -v "^WARNING: Location" || true
done
download .whl2 "${WHL2[@]}"
download .whl4 "${WHL4[@]}"
download .whl3 "${WHL3[@]}"

# every requirement of every wheel is either carried or on the machine (its list, as the device notes give it)
"$PY" - "$@" <<'EOF'
import re, zipfile, pathlib
machine = set(re.sub(r"[-_.]+", "-", name.strip().lower()) for name in """absl-py accelerate aiofiles
aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle colorama
contourpy cycler filelock fonttools frozenlist fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 joblib
kiwisolver llvmlite lxml markdown-it-py markupsafe matplotlib mdurl mpmath multidict narwhals networkx numba numpy
packaging pandas pathspec peft pillow pluggy portalocker propcache protobuf psutil pyarrow pygments pyparsing
python-dateutil pyyaml regex requests rich sacrebleu safetensors scikit-learn scipy sentencepiece setuptools
shellingham six sympy tabulate threadpoolctl tiktoken tokenizers torch tqdm transformers triton typer
typing-extensions urllib3 wrapt xxhash yarl zipp""".split())
carried = {}
for wheel in sorted(pathlib.Path(".").glob(".whl*/*.whl")):
    carried[re.sub(r"[-_.]+", "-", wheel.name.split("-")[0].lower())] = wheel
missing = set()
for wheel in carried.values():
    with zipfile.ZipFile(wheel) as archive:
        meta = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            marker = line.split(";", 1)[1] if ";" in line else ""
            if "python_version < \"3" in marker or "python_version == \"2.7\"" in marker or "sys_platform == \"win32\"" in marker or "platform_system == \"Windows\"" in marker:
                continue
            name = re.sub(r"[-_.]+", "-", re.split(r"[ <>=!~\[(;]", line.split(":", 1)[1].strip())[0].lower())
            if name not in carried and name not in machine:
                missing.add(f"{name} (needed by {wheel.name})")
print("requirements neither carried nor on the machine:", sorted(missing) or "none")
EOF

PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m benchmarks.headline_kit carry --out .device-carry/headline
du -sh .whl .whl2 .whl3 .whl4 .device-carry/headline
echo "then: WHEELS=\".whl .whl2 .whl4\" bash benchmarks/gpu_pipeline.sh pack .whlx/headline.site.tar.xz"
echo "tracked tree: $(git ls-files -z | du -ch --files0-from=- 2>/dev/null | tail -1)"

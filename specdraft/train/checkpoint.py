"""Orbax checkpoints: atomic saves of the train state plus the data iterator state; restore falls
back to the previous checkpoint when the latest is partial or corrupt."""

from __future__ import annotations

import logging

import orbax.checkpoint as ocp

from specdraft.parallel import multihost

log = logging.getLogger(__name__)


class Checkpointer:
  def __init__(self, directory: str, *, keep: int = 2):
    self.mngr = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      item_names=("state", "extra"),
    )

  def save(self, step: int, state, extra: dict) -> None:
    """Saves (state pytree, JSON extra such as the data iterator state); waits until durable."""
    self.mngr.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)),
    )
    self.mngr.wait_until_finished()

  def restore_latest(self, abstract_state):
    """(step, state, extra) of the newest readable checkpoint, or None if there is none.

    `abstract_state` (ShapeDtypeStructs with shardings) fixes the target layout.
    """
    self.mngr.reload()
    for step in sorted(self.mngr.all_steps(), reverse=True):
      out, why = None, None
      try:
        out = self.mngr.restore(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
          ),
        )
      except Exception as e:  # noqa: BLE001 -- any unreadable checkpoint falls back
        why = f"{type(e).__name__}: {str(e)[:200]}"
      # every process of a multi-process run must continue from the same step
      failed = [w for w in multihost.gather_objects(why) if w is not None]
      if not failed:
        return step, out["state"], out["extra"]
      msg = (
        f"checkpoint at step {step} in {self.mngr.directory} is unreadable ({failed[0]}); "
        "falling back to the previous one"
      )
      log.warning(msg)
      print("WARNING:", msg, flush=True)
    return None

  def close(self):
    self.mngr.close()

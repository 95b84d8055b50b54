import jax
import numpy as np
import pytest

from configs import default as default_config
from specdraft import config as config_lib
from specdraft.model import policy as pol
from specdraft.parallel import layouts
from specdraft.parallel import mesh as mesh_lib


def test_default_and_variants_validate():
  for arg in (
    "layout=dp8",
    "task=countdown,layout=fsdp8",
    "size=small,layout=dp8",
    "layout=cp4_dp2,smoke",
  ):
    config_lib.validate(default_config.get_config(arg))
  c = default_config.get_config("smoke")
  config_lib.validate(c, num_devices=1)
  c.parallel.devices = 1
  config_lib.validate(c)


def test_parse_arg():
  a = config_lib.parse_arg("size=small,smoke,seed=3", size="tiny", smoke=False, seed=0)
  assert (a.size, a.smoke, a.seed) == ("small", True, 3)
  with pytest.raises(ValueError, match="config arg 'sise' is unknown"):
    config_lib.parse_arg("sise=small", size="tiny")


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("model.n_kv_heads", 3, r"model.n_kv_heads=3 is invalid.*multiple"),
    ("model.tap_layers", (1, 4), r"model.tap_layers=\(1, 4\).*\[0, 4\)"),
    ("model.head_dim", 7, "model.head_dim=7"),
    ("task.name", "sudoku", "task.name='sudoku'"),
    ("data.seq_len", 8, r"data.seq_len=8 .*needs"),
    ("rl.temperature", -1.0, r"rl.temperature=-1.0 is invalid"),
    ("rl.top_p", 0.0, r"rl.top_p=0.0 is invalid: must be in \(0, 1\]"),
    ("rl.top_k", -2, r"rl.top_k=-2 is invalid"),
    ("draft.rollout_temperatures", (0.0, -1.0), r"draft.rollout_temperatures=.* cycled"),
    ("rl.warmup_steps", -1, r"rl.warmup_steps=-1 is invalid"),
    ("data.batch_size", 6, r"data.batch_size=6 .*data\*fsdp=8"),
    ("parallel.mesh.data", 4, "mesh size 4 .* cover 8 devices"),
    ("parallel.devices", 16, r"parallel.devices=16 is invalid"),
    ("task.arithmetic.min_digits", 5, "min_digits"),
  ],
)
def test_invalid_configs_name_the_field(field, value, match):
  c = default_config.get_config("size=tiny,layout=dp8")  # 4 layers: tap layer 4 is out of range
  node = c
  *path, last = field.split(".")
  for p in path:
    node = node[p]
  node[last] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


def test_truncated_sampling_with_a_kl_term_is_refused():
  c = default_config.get_config("layout=dp8")
  c.rl.top_k, c.rl.beta = 5, 0.01
  with pytest.raises(ValueError, match=r"rl.top_k/rl.top_p=\(5, 1.0\).*rl.beta"):
    config_lib.validate(c)


def test_heads_not_divisible_by_tensor_are_refused():
  c = default_config.get_config("smoke,layout=tp2_dp4")  # the micro model has one kv head
  with pytest.raises(ValueError, match=r"model.n_kv_heads=1 is invalid.*tensor=2"):
    config_lib.validate(c)
  c.model.n_kv_heads = 2
  config_lib.validate(c)


def test_unknown_layout_and_size():
  with pytest.raises(ValueError, match="parallel.layout='dp3'"):
    default_config.get_config("layout=dp3")
  with pytest.raises(ValueError, match="size='huge'"):
    default_config.get_config("size=huge")


@pytest.mark.parametrize("name", sorted(layouts.LAYOUTS))
def test_every_layout_builds_a_mesh(name):
  c = default_config.get_config(f"layout={name}")
  if np.prod(list(c.parallel.mesh.values())) != 8:
    with pytest.raises(ValueError, match="devices"):
      mesh_lib.make_mesh(c.parallel)
    return
  mesh = mesh_lib.make_mesh(c.parallel)
  assert mesh.axis_names == layouts.AXES
  assert dict(mesh.shape) == dict(c.parallel.mesh)


def test_param_shardings_follow_rules():
  c = default_config.get_config("layout=tp2_dp4")
  mesh = mesh_lib.make_mesh(c.parallel)
  cfg = pol.PolicyConfig(vocab_size=99, n_layers=2)
  abstract = jax.eval_shape(lambda: pol.init_params(cfg, 0))
  sh = mesh_lib.tree_shardings(
    pol.param_logical_axes(abstract), abstract, [tuple(r) for r in c.parallel.rules], mesh
  )
  assert sh["layers"]["wq"].spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
  assert sh["layers"]["w_down"].spec == jax.sharding.PartitionSpec(None, "tensor", None)
  assert sh["embed"].spec == jax.sharding.PartitionSpec(None, None)
  c = default_config.get_config("layout=fsdp8")
  mesh = mesh_lib.make_mesh(c.parallel)
  sh = mesh_lib.tree_shardings(
    pol.param_logical_axes(abstract), abstract, [tuple(r) for r in c.parallel.rules], mesh
  )
  assert sh["layers"]["wq"].spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)
  bad = pol.PolicyConfig(vocab_size=99, d_model=36, n_layers=2)
  abstract = jax.eval_shape(lambda: pol.init_params(bad, 0))
  with pytest.raises(ValueError, match="'embed' of size 36 is not divisible"):
    mesh_lib.tree_shardings(
      pol.param_logical_axes(abstract), abstract, [tuple(r) for r in c.parallel.rules], mesh
    )


def test_export_settings_the_formats_cannot_hold_are_refused_before_any_work():
  """export.dir asks for serving checkpoints: a draft the format cannot express is named."""
  c = default_config.get_config("size=tiny,layout=dp8")  # 4 layers: 2 default taps
  c.export.dir = "export"
  with pytest.raises(ValueError, match=r"model.tap_layers=2 .*exactly 3 tapped layers"):
    config_lib.validate(c)
  c.model.tap_layers = (0, 1, 2)
  config_lib.validate(c)
  c.export.dtype = "float16"
  with pytest.raises(ValueError, match=r"export.dtype='float16'.*'bfloat16'"):
    config_lib.validate(c)
  c.export.dtype = "bfloat16"
  c.draft.kind, c.decode.num_draft = "dspark", 3
  with pytest.raises(ValueError, match=r"draft.kind='dspark'.*Markov head"):
    config_lib.validate(c)
  c.draft.kind = "dflash"
  with pytest.raises(ValueError, match=r"draft.block.mask_token_id=-1"):
    config_lib.validate(c)
  c.draft.block.mask_token_id = 3
  with pytest.raises(ValueError, match=r"draft.block.qk_norm=False"):
    config_lib.validate(c)
  c.draft.block.qk_norm = True
  config_lib.validate(c)
  c.export.dir = ""  # no export: nothing is asked of the draft
  c.draft.kind = "dspark"
  config_lib.validate(c)

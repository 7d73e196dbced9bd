"""ep_plugin.config: presets, loading from paths/dicts, overrides, and the error matrix."""

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from ep_plugin.config import (
    CommConfig,
    EPConfig,
    MoEConfig,
    OverlapConfig,
    list_presets,
    load_config,
    preset_path,
)
from ep_plugin.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
PRESETS = ["deepseek_v3", "mixtral", "qwen_moe", "tiny"]


# ----------------------------------------------------------------------------------- presets


def test_presets_listed():
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name):
    by_name = load_config(name)
    by_path = load_config(REPO / "configs" / f"{name}.yaml")
    by_str_path = load_config(str(REPO / "configs" / f"{name}.yaml"))
    assert by_name == by_path == by_str_path
    assert isinstance(by_name, EPConfig)
    assert by_name.source.endswith(f"{name}.yaml")
    # round trip through to_dict
    assert load_config(by_name.to_dict()).to_dict() == by_name.to_dict()
    assert load_config(by_name) == by_name
    # presets spell every key out (no silent defaults) and comment each one
    raw = yaml.safe_load(preset_path(name).read_text())
    for sec, cls in (("moe", MoEConfig), ("comm", CommConfig), ("overlap", OverlapConfig)):
        assert set(raw[sec]) == {f.name for f in dataclasses.fields(cls)}, (name, sec)
    for line in preset_path(name).read_text().splitlines():
        if ":" in line and not line.lstrip().startswith("#") and line.startswith("  "):
            assert "#" in line, f"{name}: key without a comment: {line!r}"


def test_preset_name_with_yaml_suffix_resolves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not present in cwd: falls back to the presets
    assert load_config("tiny.yaml") == load_config("tiny")


def test_deepseek_v3_values():
    c = load_config("deepseek_v3")
    m = c.moe
    assert (m.num_experts, m.topk, m.num_groups, m.group_topk) == (256, 8, 8, 4)
    assert m.score_function == "sigmoid" and m.expert_bias is True
    assert m.topk_scaling_factor == 2.5
    assert c.comm.backend == "auto" and c.comm.num_sms == 24
    assert c.comm.dispatch_dtype == "bf16" and c.comm.max_tokens_per_rank == 4096
    assert c.comm.timeout_s == 60.0 and isinstance(c.comm.timeout_s, float)


def test_other_presets():
    assert (load_config("mixtral").moe.num_experts, load_config("mixtral").moe.topk) == (8, 2)
    q = load_config("qwen_moe").moe
    assert q.score_function == "softmax" and q.num_experts % 8 == 0
    t = load_config("tiny")
    assert t.comm.backend == "torch"
    for ep in (1, 2, 4):
        t.check_ep_size(ep)
    assert t.num_local_experts(4) == 2


# ----------------------------------------------------------------------------------- loading


def test_defaults():
    c = load_config(None)
    assert c == load_config() and c.source == "<defaults>"
    assert c.moe == MoEConfig() and c.comm == CommConfig() and c.overlap == OverlapConfig()
    assert c.to_dict() == EPConfig().to_dict()


def test_dict_partial_fills_defaults():
    c = load_config({"moe": {"num_experts": 16, "topk": 4}})
    assert c.source == "<dict>"
    assert c.moe.num_experts == 16 and c.moe.topk == 4
    assert c.moe.score_function == "softmax" and c.comm == CommConfig()


def test_empty_sections_and_file(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    assert load_config(p).to_dict() == EPConfig().to_dict()
    p.write_text("moe:\ncomm:\n")
    assert load_config(p).to_dict() == EPConfig().to_dict()


def test_int_accepted_for_float():
    c = load_config({"comm": {"timeout_s": 5}, "moe": {"topk_scaling_factor": 2}})
    assert c.comm.timeout_s == 5.0 and isinstance(c.comm.timeout_s, float)
    assert isinstance(c.moe.topk_scaling_factor, float)


def test_path_loading(tmp_path):
    p = tmp_path / "my.yaml"
    p.write_text(yaml.safe_dump({"moe": {"num_experts": 32, "topk": 4, "num_groups": 4,
                                         "group_topk": 2}, "comm": {"backend": "torch"}}))
    c = load_config(p)
    assert c.source == str(p) and c.moe.num_groups == 4 and c.comm.backend == "torch"
    assert load_config(os.fspath(p)) == c


def test_overrides_nested_and_dotted():
    base = load_config("deepseek_v3")
    a = load_config("deepseek_v3", {"comm": {"backend": "torch"}, "moe.topk_scaling_factor": 1})
    assert a.comm.backend == "torch" and a.moe.topk_scaling_factor == 1.0
    assert a.comm.num_sms == base.comm.num_sms and a.moe == dataclasses.replace(
        base.moe, topk_scaling_factor=1.0)
    b = load_config(None, {"overlap.async_dispatch": True})
    assert b.overlap.async_dispatch is True
    c = load_config(base, {"comm.dispatch_dtype": "fp8"})
    assert c.comm.dispatch_dtype == "fp8" and base.comm.dispatch_dtype == "bf16"
    # the input dict is not mutated
    d = {"moe": {"topk": 2}}
    load_config(d, {"moe.topk": 1})
    assert d == {"moe": {"topk": 2}}


def test_override_errors_are_marked():
    with pytest.raises(ConfigError) as ei:
        load_config("tiny", {"comm.backnd": "torch"})
    msg = str(ei.value)
    assert "tiny.yaml (overrides)" in msg and "comm.backnd" in msg and "backend" in msg
    with pytest.raises(ConfigError, match="section.key"):
        load_config(None, {"a.b.c": 1})


def test_check_ep_size():
    c = load_config("deepseek_v3")
    for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        c.check_ep_size(ep)
    with pytest.raises(ConfigError) as ei:
        c.check_ep_size(3)
    msg = str(ei.value)
    assert "deepseek_v3.yaml" in msg and "moe.num_experts" in msg and "3" in msg
    assert "[1, 2, 4, 8, 16, 32, 64, 128, 256]" in msg
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ConfigError):
            c.check_ep_size(bad)
    with pytest.raises(ConfigError, match="num_experts"):
        load_config({"moe": {"num_experts": 6}}).num_local_experts(4)


# ------------------------------------------------------------------------------ error matrix

# (config dict, dotted key that the message must name, fragments of the allowed values)
ERRORS = [
    ({"mooe": {}}, "mooe", ["moe", "comm", "overlap", "did you mean 'moe'"]),
    ({"moe": {"num_expert": 8}}, "moe.num_expert", ["num_experts", "did you mean"]),
    ({"comm": {"sms": 8}}, "comm.sms", ["num_sms"]),
    ({"overlap": {"async": True}}, "overlap.async", ["async_dispatch"]),
    ({"moe": {"num_experts": "8"}}, "moe.num_experts", ["positive int"]),
    ({"moe": {"num_experts": 8.0}}, "moe.num_experts", ["positive int"]),
    ({"moe": {"topk": True}}, "moe.topk", ["positive int"]),
    ({"moe": {"topk": 0}}, "moe.topk", [">= 1"]),
    ({"moe": {"expert_bias": 1, "score_function": "sigmoid"}}, "moe.expert_bias",
     ["true | false"]),
    ({"moe": {"topk_scaling_factor": "2.5"}}, "moe.topk_scaling_factor", ["float > 0"]),
    ({"moe": {"topk_scaling_factor": -1.0}}, "moe.topk_scaling_factor", ["float > 0"]),
    ({"comm": {"timeout_s": True}}, "comm.timeout_s", ["float > 0"]),
    ({"comm": {"timeout_s": 0}}, "comm.timeout_s", ["float > 0"]),
    ({"comm": {"num_sms": None}}, "comm.num_sms", ["positive int"]),
    ({"moe": {"score_function": "relu"}}, "moe.score_function", ["softmax | sigmoid"]),
    ({"comm": {"backend": "nccl"}}, "comm.backend", ["auto | torch | nvlink | nvshmem"]),
    ({"comm": {"dispatch_dtype": "fp16"}}, "comm.dispatch_dtype", ["bf16 | fp8"]),
    ({"comm": {"combine_dtype": "fp8"}}, "comm.combine_dtype", ["bf16"]),
    ({"moe": {"num_experts": 10, "num_groups": 4, "group_topk": 2}}, "moe.num_groups",
     ["divisor of 10", "[1, 2, 5, 10]"]),
    ({"moe": {"num_experts": 16, "topk": 4, "num_groups": 4, "group_topk": 8}},
     "moe.group_topk", ["1..4"]),
    ({"moe": {"num_experts": 16, "num_groups": 4}}, "moe.group_topk", ["together", "neither"]),
    ({"moe": {"num_experts": 16, "group_topk": 2}}, "moe.num_groups", ["together", "neither"]),
    ({"moe": {"num_experts": 4, "topk": 5}}, "moe.topk", ["1..4"]),
    ({"moe": {"num_experts": 16, "topk": 3, "num_groups": 4, "group_topk": 2}},
     "moe.group_topk", ["divisor of 3", "[1, 3]"]),
    ({"moe": {"num_experts": 16, "topk": 6, "num_groups": 8, "group_topk": 2}},
     "moe.topk", ["1..4"]),
    ({"moe": {"expert_bias": True}}, "moe.expert_bias", ["sigmoid"]),
    ({"moe": {"score_function": "sigmoid", "use_pre_softmax": True}}, "moe.use_pre_softmax",
     ["softmax"]),
    ({"moe": [1, 2]}, "moe", ["num_experts"]),
    # num_sms: auto, comm.host_sync, comm.combine_kernel, did-you-mean on choices
    ({"comm": {"num_sms": "Auto"}}, "comm.num_sms",
     ["positive int (>= 1) or auto", "did you mean 'auto'"]),
    ({"comm": {"num_sms": 0}}, "comm.num_sms", ["out of range", "or auto"]),
    ({"comm": {"num_sms": 2.5}}, "comm.num_sms", ["wrong type", "or auto"]),
    ({"comm": {"host_sync": "false"}}, "comm.host_sync", ["true | false"]),
    ({"comm": {"combine_kernel": "fusd"}}, "comm.combine_kernel",
     ["split | fused", "did you mean 'fused'"]),
    ({"comm": {"combine_kernel": 1}}, "comm.combine_kernel", ["split | fused"]),
    ({"comm": {"dispatch_kernel": "fusde"}}, "comm.dispatch_kernel", ["did you mean 'fused'", "split | fused"]),
    ({"moe": {"score_function": "softmx"}}, "moe.score_function",
     ["softmax | sigmoid | sqrtsoftplus", "did you mean 'softmax'"]),
]


@pytest.mark.parametrize("cfg,key,allowed", ERRORS, ids=[e[1] for e in ERRORS])
def test_error_matrix_dict(cfg, key, allowed):
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert msg.startswith("<dict>: "), msg
    assert f"{key}:" in msg, msg
    for frag in allowed:
        assert frag in msg, (frag, msg)


@pytest.mark.parametrize("cfg,key,allowed", ERRORS, ids=[e[1] for e in ERRORS])
def test_error_matrix_file(tmp_path, cfg, key, allowed):
    p = tmp_path / "bad_config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "bad_config.yaml" in msg, msg
    assert f"{key}:" in msg, msg
    for frag in allowed:
        assert frag in msg, (frag, msg)


def test_yaml_exponent_hint(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("comm:\n  timeout_s: 1e3\n")  # PyYAML reads this as a string
    with pytest.raises(ConfigError, match="1.0e3"):
        load_config(p)


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="presets"):
        load_config("no_such_preset")
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    p = tmp_path / "broken.yaml"
    p.write_text("moe: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml.*not valid YAML"):
        load_config(p)
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="broken.yaml.*mapping"):
        load_config(p)
    with pytest.raises(ConfigError):
        load_config(42)


# ------------------------------------------------------------------------- new keys and choices


def test_num_sms_auto_and_new_comm_keys():
    c = load_config({"comm": {"num_sms": "auto", "host_sync": False, "combine_kernel": "fused"}})
    assert c.comm.num_sms == "auto" and c.comm.host_sync is False
    assert c.comm.combine_kernel == "fused"
    d = CommConfig()
    assert (d.num_sms, d.host_sync, d.combine_kernel) == (24, False, "auto")
    assert load_config(c.to_dict()) == c


def test_expert_bias_with_sqrtsoftplus():
    m = load_config({"moe": {"score_function": "sqrtsoftplus", "expert_bias": True}}).moe
    assert m.score_function == "sqrtsoftplus" and m.expert_bias is True
    with pytest.raises(ConfigError, match="sigmoid or sqrtsoftplus"):
        load_config({"moe": {"expert_bias": True}})


def test_each_choice_list_is_defined_once():
    import ep_plugin.config as config
    import ep_plugin.config.validate as validate
    from ep_plugin import routing
    from ep_plugin.backends import registry

    assert routing.SCORE_FUNCTIONS is config.SCORE_FUNCTIONS
    assert set(config.SCORE_FUNCTIONS) == {"softmax", "sigmoid", "sqrtsoftplus"}
    assert config.BACKEND_NAMES is registry.BACKEND_NAMES
    rules = validate.RULES
    assert rules["moe"]["score_function"][1] is config.SCORE_FUNCTIONS
    assert rules["comm"]["backend"][1] is registry.BACKEND_NAMES
    assert rules["comm"]["dispatch_dtype"][1] is config.DISPATCH_DTYPES
    assert rules["comm"]["combine_dtype"][1] is config.COMBINE_DTYPES
    assert rules["comm"]["combine_kernel"][1] is config.COMBINE_KERNELS


# ---------------------------------------------------------------------- environment overrides

WORST_CASE, COMBINE, DISPATCH = "EP_PLUGIN_NVLINK_WORST_CASE", "EP_PLUGIN_NVLINK_COMBINE", "EP_PLUGIN_NVLINK_DISPATCH"
LL_REDUCE = "EP_PLUGIN_LL_COMBINE_REDUCE"
SPARES = "EP_PLUGIN_NVLINK_SPARES"


@pytest.fixture
def clean_env(monkeypatch):
    for var in (WORST_CASE, COMBINE, DISPATCH, LL_REDUCE, SPARES, "EP_PLUGIN_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("text,host_sync", [("1", False), ("true", False), (" ON ", False),
                                            ("0", True), ("no", True)])
def test_env_worst_case_overrides_host_sync(clean_env, text, host_sync):
    clean_env.setenv(WORST_CASE, text)
    # the environment wins over the file, a dict and the overrides argument
    assert load_config("tiny").comm.host_sync is host_sync
    assert load_config({"comm": {"host_sync": not host_sync}}).comm.host_sync is host_sync
    assert load_config(None, {"comm.host_sync": not host_sync}).comm.host_sync is host_sync


@pytest.mark.parametrize("var,key", [(COMBINE, "combine_kernel"), (DISPATCH, "dispatch_kernel")])
@pytest.mark.parametrize("kernel", ["split", "fused"])
def test_env_overrides_kernel_choice(clean_env, var, key, kernel):
    clean_env.setenv(var, kernel)
    other = "fused" if kernel == "split" else "split"
    assert getattr(load_config({"comm": {key: other}}).comm, key) == kernel
    assert getattr(load_config("deepseek_v3").comm, key) == kernel
    clean_env.setenv(var, "fuse")
    with pytest.raises(ConfigError, match=f"{var}='fuse'.*comm.{key}.*did you mean 'fused'"):
        load_config("tiny")


def test_env_switches_spare_outputs(clean_env):
    assert load_config(None).comm.spare_outputs is True
    clean_env.setenv(SPARES, "off")
    assert load_config({"comm": {"spare_outputs": True}}).comm.spare_outputs is False
    clean_env.setenv(SPARES, "1")
    assert load_config({"comm": {"spare_outputs": False}}).comm.spare_outputs is True
    clean_env.setenv(SPARES, "maybe")
    with pytest.raises(ConfigError, match=f"{SPARES}='maybe'.*comm.spare_outputs"):
        load_config("tiny")


def test_env_overrides_low_latency_combine_reduce(clean_env):
    """A key of a subsection (comm.low_latency) from the environment, beside the section's other keys."""
    assert load_config(None).comm.low_latency.combine_reduce == "owner"
    clean_env.setenv(LL_REDUCE, "source")
    c = load_config({"comm": {"low_latency": {"max_tokens_per_rank": 64, "combine_reduce": "owner"}}})
    assert c.comm.low_latency.combine_reduce == "source" and c.comm.low_latency.max_tokens_per_rank == 64
    assert load_config("tiny").comm.low_latency.combine_reduce == "source"
    clean_env.setenv(LL_REDUCE, "owners")
    with pytest.raises(ConfigError, match=f"{LL_REDUCE}='owners'.*combine_reduce.*did you mean 'owner'"):
        load_config(None)


def test_env_unset_or_empty_is_no_override(clean_env):
    clean_env.setenv(WORST_CASE, "")
    clean_env.setenv(COMBINE, "  ")
    c = load_config({"comm": {"host_sync": False, "combine_kernel": "fused"}})
    assert c.comm.host_sync is False and c.comm.combine_kernel == "fused"


@pytest.mark.parametrize("var,text,fragments", [
    (WORST_CASE, "2", ["comm.host_sync", "1 | true | yes | on", "0 | false | no | off"]),
    (WORST_CASE, "worst", ["comm.host_sync"]),
    (COMBINE, "fusd", ["comm.combine_kernel", "did you mean 'fused'", "split | fused"]),
    (COMBINE, "FUSED", ["comm.combine_kernel", "split | fused"]),
])
def test_env_invalid_values_name_the_variable(clean_env, var, text, fragments):
    clean_env.setenv(var, text)
    with pytest.raises(ConfigError) as ei:
        load_config("tiny")
    msg = str(ei.value)
    assert msg.startswith(f"{var}={text!r} (environment)"), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_env_does_not_hide_a_malformed_file(clean_env, tmp_path):
    clean_env.setenv(COMBINE, "fused")
    p = tmp_path / "bad.yaml"
    p.write_text("comm: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: comm: must be a mapping"):
        load_config(p)


# ----------------------------------------------------------------------------- preset shipping


def test_presets_ship_in_the_package_and_configs_links_to_them():
    import ep_plugin.config as config

    shipped = Path(config.__file__).resolve().parent / "presets"
    for name in PRESETS:
        real = shipped / f"{name}.yaml"
        assert real.is_file() and not real.is_symlink(), real
        assert preset_path(name) == real
        link = REPO / "configs" / f"{name}.yaml"  # the documented repository path: one copy
        assert link.is_symlink() and link.resolve() == real, link


def test_presets_from_another_cwd(clean_env, tmp_path):
    clean_env.chdir(tmp_path)
    assert set(PRESETS) <= set(list_presets())
    c = load_config("deepseek_v3")
    assert c.moe.num_experts == 256 and Path(c.source).is_absolute()


def test_presets_in_a_built_package(tmp_path):
    """What a wheel holds: build_py copies the package with its package_data into tmp_path; that
    copy, imported from another directory, finds every preset."""
    import subprocess
    import sys

    env = {**os.environ, "EP_PLUGIN_BUILD_C": "0"}
    env.pop("EP_PLUGIN_CONFIG_DIR", None)
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "lib")],
                   cwd=REPO, env=env, check=True, capture_output=True)
    shipped = sorted(p.name for p in (tmp_path / "lib/ep_plugin/config/presets").glob("*.yaml"))
    assert shipped == sorted(f"{n}.yaml" for n in PRESETS)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ep_plugin.config as c; "
            "print(c.load_config('deepseek_v3').source); print(' '.join(c.list_presets()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lib")], cwd=tmp_path,
                         env=env, check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0] == str(tmp_path / "lib/ep_plugin/config/presets/deepseek_v3.yaml")
    assert set(PRESETS) <= set(out[1].split())


def test_config_dir_env_is_searched_first(clean_env, tmp_path):
    (tmp_path / "mine.yaml").write_text("moe:\n  num_experts: 32\n")
    (tmp_path / "tiny.yaml").write_text("moe:\n  num_experts: 4\n")
    clean_env.setenv("EP_PLUGIN_CONFIG_DIR", str(tmp_path))
    assert {"mine", "tiny", "deepseek_v3"} <= set(list_presets())
    assert load_config("mine").moe.num_experts == 32
    assert load_config("tiny").moe.num_experts == 4
    clean_env.setenv("EP_PLUGIN_CONFIG_DIR", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"EP_PLUGIN_CONFIG_DIR=.*absent \(not a directory\)"):
        load_config("mine")


# ------------------------------------------------------- every problem at once, keys written twice


def test_every_problem_of_a_file_at_once(tmp_path):
    p = tmp_path / "many.yaml"
    p.write_text("moe:\n  topk: two\n  score_function: sigmod\ncomm:\n  backend: nvlnk\noverlap:\n  recvhook: true\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.splitlines()[0] == f"{p}: 4 problems:"
    for part in ("moe.topk: wrong type", "did you mean 'sigmoid'", "comm.backend: not an allowed value",
                 "did you mean 'nvlink'", "overlap.recvhook: unknown key (did you mean 'recv_hook'?)"):
        assert part in msg
    assert [q.key for q in ei.value.problems] == ["moe.topk", "moe.score_function", "comm.backend",
                                                  "overlap.recvhook"]


def test_one_problem_keeps_its_one_line(tmp_path):
    p = tmp_path / "one.yaml"
    p.write_text("comm:\n  backend: nvlnk\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).startswith(f"{p}: comm.backend: not an allowed value (did you mean 'nvlink'?)")
    assert "\n" not in str(ei.value)


def test_cross_key_rules_skip_a_section_with_bad_keys(tmp_path):
    # num_groups is wrong: the group rules would only repeat it; the comm problem is still reported
    with pytest.raises(ConfigError) as ei:
        load_config({"moe": {"num_experts": 8, "num_groups": "x", "group_topk": 9}, "comm": {"stats": 1}})
    assert [q.key for q in ei.value.problems] == ["moe.num_groups", "comm.stats"]


def test_a_key_written_twice_names_file_key_and_both_lines(tmp_path):
    p = tmp_path / "twice.yaml"
    p.write_text("moe:\n  topk: 2\ncomm:\n  backend: torch\n  num_sms: 8\n  backend: nvlink\n")
    with pytest.raises(ConfigError, match=rf"{p}: comm.backend: written twice \(lines 4 and 6\)"):
        load_config(p)
    p.write_text("moe:\n  topk: 2\nmoe:\n  topk: 3\n  topk: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert [q.key for q in ei.value.problems] == ["moe", "moe.topk"]
    assert "lines 1 and 3" in str(ei.value) and "lines 4 and 5" in str(ei.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("base: &b\n  topk: 2\nmoe:\n  <<: *b\n  num_experts: 8\n")
    from ep_plugin.config import read_yaml

    assert read_yaml(p)["moe"] == {"topk": 2, "num_experts": 8}


@pytest.mark.parametrize("name", PRESETS)
def test_shipped_presets_write_each_key_once(name):
    from ep_plugin.config import read_yaml

    read_yaml(preset_path(name))  # raises on a key written twice


def test_a_dict_names_the_file_it_came_from():
    with pytest.raises(ConfigError, match=r"^examples/x.yaml: comm.backend"):
        load_config({"comm": {"backend": "nvlnk"}}, source="examples/x.yaml")
    with pytest.raises(ConfigError, match=r"^<dict>: comm.backend"):
        load_config({"comm": {"backend": "nvlnk"}})
    assert load_config({}, source="a.yaml").source == "a.yaml"


def test_megatron_dispatcher_config_names_the_attached_file(tmp_path):
    from types import SimpleNamespace

    from ep_plugin.integrations.megatron.config import attach_config, resolve_config

    p = tmp_path / "attached.yaml"
    p.write_text("comm:\n  backend: torch\n  max_tokens_per_rank: 64\n")
    tc = SimpleNamespace()
    attach_config(tc, str(p))
    cfg = resolve_config(tc, num_experts=4, topk=2)
    assert cfg.source == str(p) and cfg.comm.max_tokens_per_rank == 64 and cfg.moe.num_experts == 4
    with pytest.raises(ConfigError, match=rf"^{p}: moe.topk"):
        resolve_config(tc, num_experts=4, topk=5)

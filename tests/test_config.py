"""Config loading, overrides and bad input; SamplingParams validation; launch.py's fast paths."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.config import ConfigError, RuntimeConfig, load_config, to_yaml
from runtime.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------------------------------------
# load_config: good input
# ---------------------------------------------------------------------------------------------------------
def test_defaults_without_files_or_overrides():
    cfg = load_config()
    assert isinstance(cfg, RuntimeConfig)
    assert cfg.cache.page_size == RuntimeConfig().cache.page_size


def test_overrides_take_effect_with_their_types():
    cfg = load_config([], [
        "cache.page_size=1", "cache.memory_ratio=0.5", "scheduler.overlap=false", "sampling.temperature=0.7",
        "sampling.top_k=20", "sampling.seed=123", "model.dtype=float32", "job.input=rows.jsonl",
    ])
    assert cfg.cache.page_size == 1 and isinstance(cfg.cache.page_size, int)
    assert cfg.cache.memory_ratio == 0.5
    assert cfg.scheduler.overlap is False
    assert cfg.sampling.temperature == pytest.approx(0.7)
    assert cfg.sampling.top_k == 20
    assert cfg.sampling.seed == 123
    assert cfg.model.dtype == "float32"
    assert cfg.job.input == "rows.jsonl"


def test_later_files_override_earlier_ones_and_overrides_win(tmp_path):
    a = write(tmp_path, "a.yaml", """
        cache:
          page_size: 8
          memory_ratio: 0.5
        sampling:
          temperature: 0.5
    """)
    b = write(tmp_path, "b.yaml", """
        cache:
          page_size: 32
    """)
    cfg = load_config([a, b])
    assert cfg.cache.page_size == 32  # b wins
    assert cfg.cache.memory_ratio == 0.5  # untouched by b: a's value survives
    assert cfg.sampling.temperature == 0.5
    assert load_config([b, a]).cache.page_size == 8
    assert load_config([a, b], ["cache.page_size=4"]).cache.page_size == 4
    # overrides apply in order too
    assert load_config([a], ["cache.page_size=4", "cache.page_size=64"]).cache.page_size == 64


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "configs").rglob("*.yaml") if "sweeps" not in p.parts),
                         ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every shipped run config loads (configs/sweeps/ holds sweep files, tested with the sweeps); configs/bench/
    files may set the benchmark's own section too."""
    if "bench" in path.parts:
        from scripts.bench_config import load_bench_config

        load_bench_config([path])
    else:
        load_config([path])


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config([], ["cache.page_size=3", "sampling.top_p=0.5"])
    again = load_config([write(tmp_path, "dump.yaml", to_yaml(cfg))])
    assert again == cfg


def test_token_ids_may_be_quoted_keys_as_json_writes_them(tmp_path):
    """sampling.logit_bias keys are token ids: ``'50256'`` (JSON, most YAML writers, a sweep's override text)
    reads as the int 50256, in a file and in an override, the same config as the unquoted key."""
    unquoted = load_config([], ["sampling.logit_bias={50256: -100, 13: 2.5}"])
    assert unquoted.sampling.logit_bias == {50256: -100.0, 13: 2.5}
    path = write(tmp_path, "bias.yaml", """\
        sampling:
          logit_bias:
            '50256': -100
            "13": 2.5
        """)
    assert load_config([path]) == unquoted
    assert load_config([], ["""sampling.logit_bias={'50256': -100, "13": 2.5}"""]) == unquoted


def test_a_later_logit_bias_replaces_the_earlier_whole(tmp_path):
    """A mapping is one value: a later file or an override (as a sweep's run gives it) replaces it, and ``{}``
    clears it, where a key-by-key merge would keep the base config's biases."""
    base = write(tmp_path, "base.yaml", "sampling:\n  logit_bias:\n    50256: -100\n    13: 2\n")
    assert load_config([base]).sampling.logit_bias == {50256: -100.0, 13: 2.0}
    assert load_config([base], ["sampling.logit_bias={7: 1}"]).sampling.logit_bias == {7: 1.0}
    assert load_config([base], ["sampling.logit_bias={}"]).sampling.logit_bias == {}
    later = write(tmp_path, "later.yaml", "sampling:\n  logit_bias: {'13': 5}\n")
    assert load_config([base, later]).sampling.logit_bias == {13: 5.0}
    assert load_config([base], ["sampling.top_p=0.5"]).sampling.logit_bias == {50256: -100.0, 13: 2.0}


@pytest.mark.parametrize("key", ["abc", "-1", "1.5"])
def test_a_logit_bias_key_that_is_no_token_id_is_named(tmp_path, key):
    path = write(tmp_path, "bias.yaml", f"sampling:\n  logit_bias:\n    '{key}': 1\n")
    with pytest.raises(ConfigError, match=f"bias.yaml: sampling.logit_bias maps token ids .*'{re.escape(key)}' is not one"):
        load_config([path])
    with pytest.raises(ConfigError, match=f"sampling.logit_bias maps token ids .*'{re.escape(key)}' is not one"):
        load_config([], [f"sampling.logit_bias={{'{key}': 1}}"])


# ---------------------------------------------------------------------------------------------------------
# load_config: bad input
# ---------------------------------------------------------------------------------------------------------
def test_unknown_key_in_yaml_names_it_and_suggests_the_nearest(tmp_path):
    path = write(tmp_path, "typo.yaml", """
        cache:
          page_sise: 1
    """)
    with pytest.raises(ConfigError) as err:
        load_config([path])
    msg = str(err.value)
    assert "cache.page_sise" in msg
    assert "cache.page_size" in msg  # the suggestion
    assert "typo.yaml" in msg


def test_unknown_section_in_yaml(tmp_path):
    path = write(tmp_path, "sect.yaml", "cahce:\n  page_size: 1\n")
    with pytest.raises(ConfigError, match="cahce") as err:
        load_config([path])
    assert "'cache'" in str(err.value)


@pytest.mark.parametrize("text,key,nested", [
    ("sampling.temperature: 0.7\n", "sampling.temperature", "sampling: {temperature: VALUE}"),
    ("job:\n  columns.prompt: question\n", "job.columns.prompt", "job: {columns: {prompt: VALUE}}"),
])
def test_a_dotted_key_in_yaml_says_to_nest_it(tmp_path, text, key, nested):
    path = write(tmp_path, "dotted.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_config([path])
    msg = str(err.value)
    assert f"'{key}'" in msg and nested in msg, msg
    assert "did you mean" not in msg


def test_unknown_key_in_override_names_it_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config([], ["cache.page_sise=1"])
    msg = str(err.value)
    assert "cache.page_sise" in msg and "cache.page_size" in msg


def test_unknown_key_without_near_match_has_no_bogus_suggestion():
    with pytest.raises(ConfigError, match="cache.zzzzzzzz") as err:
        load_config([], ["cache.zzzzzzzz=1"])
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cache.page_size=abc", "cache.page_size"),
        ("cache.page_size=1.5", "cache.page_size"),
        ("cache.memory_ratio=lots", "cache.memory_ratio"),
        ("scheduler.overlap=maybe", "scheduler.overlap"),
        ("sampling.seed=abc", "sampling.seed"),
        # values of the right type that are out of range or not a choice
        ("cache.page_size=0", "cache.page_size"),
        ("cache.memory_ratio=1.5", "cache.memory_ratio"),
        ("cache.memory_ratio=0", "cache.memory_ratio"),
        ("scheduler.admit_free_share=1.5", "scheduler.admit_free_share"),
        ("job.drain_timeout_s=nan", "job.drain_timeout_s"),
        ("job.fsync_every_s=nan", "job.fsync_every_s"),
        ("scheduler.admit_free_share=-0.1", "scheduler.admit_free_share"),
        ("model.dtype=fp8", "model.dtype"),
        ("engine.device=tpu", "engine.device"),
        ("scheduler.max_running_requests=0", "scheduler.max_running_requests"),
    ],
)
def test_wrong_type_or_bad_value_in_override_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([], [override])


def test_text_keys_keep_their_values_as_written(tmp_path):
    """YAML 1.1 reads `off`, `no` and `on` as booleans and `012345`, `1_0` and `0x1F` as numbers; keys that hold
    text keep what was written (an API key, a stop string), on the command line and in files alike."""
    with pytest.raises(ConfigError, match=r"engine\.fused_gemv'='off' must be one of \['auto', 'always', 'never'\]"):
        load_config([], ["engine.fused_gemv=off"])
    (tmp_path / "c.yaml").write_text("server:\n  api_key: 012345\n  served_model_name: yes\nsampling:\n"
                                     "  stop: [no, '1_0', 1_0]\n  temperature: 0\n")
    for cfg in (load_config([tmp_path / "c.yaml"]),
                load_config([], ["server.api_key=012345", "server.served_model_name=yes", "sampling.stop=[no,'1_0',1_0]",
                                 "sampling.temperature=0"])):
        assert (cfg.server.api_key, cfg.server.served_model_name) == ("012345", "yes")
        assert list(cfg.sampling.stop) == ["no", "1_0", "1_0"] and cfg.sampling.temperature == 0.0
    cfg = load_config([], ["job.prompts=[on, 0x1F]", "model.path=1:20", "server.api_key=null", "cache.page_size=0x10"])
    assert (list(cfg.job.prompts), cfg.model.path, cfg.server.api_key) == (["on", "0x1F"], "1:20", None)
    assert cfg.cache.page_size == 16  # a number key reads YAML numbers as before
    assert load_config([], ["engine.fused_gemv=never"]).engine.fused_gemv == "never"


def test_wrong_type_in_yaml_names_the_key(tmp_path):
    path = write(tmp_path, "type.yaml", "cache:\n  page_size: abc\n")
    with pytest.raises(ConfigError, match=r"cache\.page_size"):
        load_config([path])


def test_a_wrong_type_is_one_line_without_omegaconfs_internals():
    with pytest.raises(ConfigError) as info:
        load_config([], ["cache.page_size=abc"])
    message = str(info.value)
    assert "'abc'" in message and "cache.page_size" in message
    assert "\n" not in message and "object_type" not in message and "reference_type" not in message


def test_a_scalar_for_a_list_key_says_it_takes_a_list(tmp_path):
    with pytest.raises(ConfigError, match=r"^override 'sampling.stop=END': config key 'sampling.stop' takes a list, "
                                          r"e.g. sampling.stop=\[a,b\]"):
        load_config([], ["sampling.stop=END"])
    path = write(tmp_path, "stop.yaml", "job:\n  columns:\n    keep: answer\n")
    with pytest.raises(ConfigError, match=r"config key 'job.columns.keep' takes a list"):
        load_config([path])
    assert load_config([], ["sampling.stop=[END]"]).sampling.stop == ["END"]


@pytest.mark.parametrize(("override", "yaml_text", "key", "first"), [
    ("cache=5", "cache: [1, 2]\n", "cache", "page_size"),
    ("job.columns=3", "job:\n  columns: qid\n", "job.columns", "id"),
])
def test_a_value_for_a_section_names_the_section(tmp_path, override, yaml_text, key, first):
    with pytest.raises(ConfigError, match=rf"^override '{override}': config key '{key}' is a section, not a value "
                                          rf"\(\S+\): set its keys, e\.g\. {key}\.{first}=VALUE"):
        load_config([], [override])
    path = write(tmp_path, "section.yaml", yaml_text)
    with pytest.raises(ConfigError, match=rf"section\.yaml: config key '{key}' is a section, not a value"):
        load_config([path])


def test_an_empty_value_names_the_key_and_what_it_takes(tmp_path):
    with pytest.raises(ConfigError, match=r"^override 'model\.path=': config key 'model\.path' needs a value of type "
                                          r"'str', e\.g\. model\.path=VALUE; an empty one .* is null$"):
        load_config([], ["model.path="])
    path = write(tmp_path, "empty.yaml", "cache:\n  page_size:\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: config key 'cache\.page_size' needs a value of type 'int'"):
        load_config([path])
    assert load_config([], ["job.input="]).job.input is None  # a key that takes null


def test_a_yaml_section_with_every_key_commented_out_sets_nothing(tmp_path):
    path = write(tmp_path, "commented.yaml", """\
        sampling:
          # temperature: 0.7
        job:
          columns:
            # id: qid
        cache:
          page_size: 8
        """)
    cfg = load_config([path])
    assert cfg.sampling == RuntimeConfig().sampling and cfg.job.columns == RuntimeConfig().job.columns
    assert cfg.cache.page_size == 8


@pytest.mark.parametrize("text", ["cache: [page_size: 1\n", "cache:\n  page_size: 1\n bad indent: 2\n", "{{{\n"])
def test_malformed_yaml(tmp_path, text):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config([path])


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml"):
        load_config([path])


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config([missing])


@pytest.mark.parametrize("override", ["cache.page_size", "=3", "justtext"])
def test_bad_override_syntax(override):
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], [override])


@pytest.mark.parametrize(
    ("override", "name"),
    [
        ("sampling.temperature=-0.5", "temperature"),
        ("sampling.top_p=0", "top_p"),
        ("sampling.top_p=1.5", "top_p"),
        ("sampling.top_p=-0.1", "top_p"),
        ("sampling.max_new_tokens=0", "max_new_tokens"),
        ("sampling.max_new_tokens=-4", "max_new_tokens"),
        ("sampling.top_k=-2", "top_k"),
        ("sampling.seed=-1", "seed"),
    ],
)
def test_bad_sampling_values_in_config(override, name):
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    msg = str(err.value)
    assert "sampling" in msg and name in msg


def test_bad_sampling_value_in_yaml(tmp_path):
    path = write(tmp_path, "s.yaml", "sampling:\n  temperature: -1\n")
    with pytest.raises(ConfigError, match="temperature"):
        load_config([path])


# ---------------------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 3.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_accept_boundary_values():
    for kwargs in ({"temperature": 0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"max_new_tokens": 1}, {"top_k": -1},
                   {"top_k": 0}, {"top_k": 1}, {"seed": 0}, {"stop": "END"}):
        SamplingParams(**kwargs)
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy


def test_sampling_params_from_dict():
    base = SamplingParams(temperature=0.3, max_new_tokens=9)
    sp = SamplingParams.from_dict({"top_p": 0.5}, base=base)
    assert (sp.temperature, sp.top_p, sp.max_new_tokens) == (0.3, 0.5, 9)
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2}, base=base)


def schedule_one(params: SamplingParams, run_seed: int = 0):
    from runtime.batch import Req, unseeded_key
    from runtime.config import SchedulerSection
    from runtime.scheduler import Scheduler

    sched = Scheduler(SchedulerSection(), num_pages=16, page_size=16, max_seq_len=128, dummy_row=255)
    sched.add(Req(0, [1, 2, 3], params, 4, stream=unseeded_key(run_seed, 0)))
    return sched.schedule()


def test_sampling_limits_are_refused_at_validation_or_fit_the_batch():
    """A seed of 2**63 does not fit int64 and is refused up front (a per-request ValueError); top_k=2**31 is
    accepted and must fit the batch's int32 array (it restricts nothing, so it becomes -1)."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**63)
    batch = schedule_one(SamplingParams(temperature=1.0, seed=2**63 - 1))
    assert batch is not None and int(batch.seeds[0]) == 2**63 - 1
    batch = schedule_one(SamplingParams(temperature=1.0, top_k=2**31))
    assert batch is not None and int(batch.top_k[0]) == -1


def test_accepted_engine_seed_can_be_scheduled():
    """Unseeded requests hash (engine.seed, the row's key) into an int64 seed: the largest accepted engine.seed schedules,
    and the next one is refused at load."""
    with pytest.raises(ConfigError, match="engine.seed"):
        load_config([], [f"engine.seed={2**31}"])
    cfg = load_config([], [f"engine.seed={2**31 - 1}"])
    batch = schedule_one(SamplingParams(temperature=1.0), run_seed=cfg.engine.seed)
    assert batch is not None and batch.size == 1 and 0 <= int(batch.seeds[0]) < 2**63


# ---------------------------------------------------------------------------------------------------------
# launch.py: --print-config and a typo fail fast, without loading a model
# ---------------------------------------------------------------------------------------------------------
def run_launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_launch_print_config():
    proc = run_launch("--print-config", "cache.page_size=1")
    assert proc.returncode == 0, proc.stderr
    assert "page_size: 1\n" in proc.stdout
    assert "cache:" in proc.stdout and "sampling:" in proc.stdout


def test_launch_options_may_follow_the_overrides():
    proc = run_launch("serve", "server.port=7", "--print-config")
    assert proc.returncode == 0 and "port: 7\n" in proc.stdout, proc.stderr


def test_launch_exits_1_when_no_prompt_could_be_served():
    proc = run_launch("engine.device=cpu", "sampling.max_new_tokens=2", "job.prompts=[hi,yo]", "model.max_seq_len=4")
    assert proc.returncode == 1 and "the maximum sequence length is 4" in proc.stdout, proc.stderr
    proc = run_launch("engine.device=cpu", "sampling.max_new_tokens=2", "job.prompts=[hi]", "model.max_seq_len=64",
                      "job.chat_template=false")
    assert proc.returncode == 0 and "1 requests" in proc.stdout, proc.stderr


def test_launch_unknown_key_fails_naming_it():
    proc = run_launch("cache.page_sise=1")
    assert proc.returncode != 0
    assert "cache.page_sise" in proc.stderr
    assert "cache.page_size" in proc.stderr
    assert "###" not in proc.stdout and "tokens/s" not in proc.stdout  # nothing was generated


def test_launch_serve_after_the_overrides_is_named():
    proc = run_launch("server.port=0", "serve")
    assert proc.returncode == 2
    assert "'serve' comes first" in proc.stderr, proc.stderr
    assert "not of the form key=value" not in proc.stderr


def test_launch_serve_on_a_busy_port_or_a_bad_host_fails_before_the_model_loads():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_launch("serve", "engine.device=cpu", f"server.port={port}")
    assert proc.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port} (server.host, server.port)" in proc.stderr
    assert "weights" not in proc.stderr + proc.stdout, proc.stderr  # nothing loaded
    proc = run_launch("serve", "engine.device=cpu", "server.host=127.0.0.256", "server.port=0")
    assert proc.returncode == 2 and "error: cannot listen on 127.0.0.256:0" in proc.stderr, proc.stderr


def test_launch_a_value_list_without_sweep_points_to_sweep():
    proc = run_launch("sampling.temperature=0,0.7")
    assert proc.returncode == 2
    assert "sampling.temperature" in proc.stderr and "--sweep sampling.temperature=0,0.7" in proc.stderr, proc.stderr
    proc = run_launch("--print-config", "sampling.temperature=hot")
    assert proc.returncode == 2 and "--sweep" not in proc.stderr, proc.stderr


def test_launch_fast_paths_import_no_model_code():
    """Run launch.main in a fresh interpreter and check the model / engine modules were never imported."""
    code = textwrap.dedent("""
        import sys
        import launch
        rc1 = launch.main(["--print-config", "cache.page_size=1"])
        rc2 = launch.main(["cache.page_sise=1"])
        heavy = sorted(m for m in ("runtime.frontend.llm", "runtime.engine", "models") if m in sys.modules)
        print("RESULT", rc1, rc2, heavy)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    rc1, rc2, heavy = line.split(" ", 3)[1:]
    assert rc1 == "0" and rc2 != "0"
    assert heavy == "[]"


def test_interpolation_and_environment_in_presets(tmp_path, monkeypatch):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("TPINFER_MODEL_DIR", str(tmp_path))
    cfg = load_config([repo / "configs" / "local_model.yaml"])
    assert cfg.model.path == str(tmp_path)
    layer = tmp_path / "extra.yaml"
    layer.write_text("scheduler:\n  max_prefill_tokens: ${model.max_seq_len}\n")
    cfg = load_config([repo / "configs" / "local_model.yaml", layer], ["model.max_seq_len=2048"])
    assert cfg.scheduler.max_prefill_tokens == 2048


@pytest.mark.parametrize("values,named", [
    ({"ignore_eos": "false"}, "ignore_eos"), ({"temperature": True}, "temperature"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop": None}, "stop"), ({"stop": 5}, "stop"),
    ({"top_p": "0.5"}, "top_p"), ({"max_new_tokens": 2.0}, "max_new_tokens"), ({"seed": 1.5}, "seed"),
])
def test_sampling_values_are_not_coerced(values, named):
    with pytest.raises(ValueError, match=f"sampling parameter {named}="):
        SamplingParams.from_dict(values)


def test_numpy_scalars_are_taken_as_the_python_numbers_they_hold():
    import json

    import numpy as np

    params = SamplingParams(seed=np.int64(7), n=np.int32(2), top_k=np.int16(5), top_p=np.float32(0.5),
                            temperature=np.float64(0.25), logprobs=np.uint8(3), stop_token_ids=[np.int64(9)])
    assert (params.seed, params.n, params.top_k, params.top_p, params.temperature) == (7, 2, 5, 0.5, 0.25)
    assert params.logprobs == 3 and params.stop_token_ids == [9]
    json.dumps(vars(params))  # plain Python numbers: the results' JSON takes them
    for bad in ({"seed": np.bool_(True)}, {"top_k": np.float64(2.0)}, {"seed": np.int64(-1)}):
        with pytest.raises(ValueError, match=f"sampling parameter {next(iter(bad))}="):
            SamplingParams(**bad)


def test_a_config_without_architectures_is_not_taken_for_llama():
    from models.config import ModelConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match="model_type 'gemma'") as err:
        ModelConfig.from_dict({**base, "model_type": "gemma"})
    assert "LlamaForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)
    assert ModelConfig.from_dict({**base, "model_type": "llama"}).architecture == "LlamaForCausalLM"
    assert ModelConfig.from_dict({**base, "model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("override,named", [
    ("cache.num_pages=-3", "cache.num_pages"), ("cache.num_pages=1", "cache.num_pages"),
    ("job.drain_timeout_s=-1", "job.drain_timeout_s"), ("job.fsync_every_s=-1", "job.fsync_every_s"),
    ("parallel.timeout_s=0", "parallel.timeout_s"), ("cache.cpu_memory_bytes=0", "cache.cpu_memory_bytes"),
    ("engine.cuda_graph_max_bs=-1", "engine.cuda_graph_max_bs"),
])
def test_out_of_range_values_fail_at_load_naming_the_key(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config([], [override])


def test_launch_checks_the_job_input_before_it_loads_the_model(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "prompt": "hi"}\n')
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    table = tmp_path / "rows.parquet"
    table.write_text("not parquet at all")
    cases = [(batch, "out.parquet", []), (table, "out.jsonl", []), (rows, "out.jsonl", ["job.columns.keep=[x]"])]
    for source, output, extra in cases:
        proc = run_launch(f"job.input={source}", f"job.output={tmp_path / output}", "model.path=/nonexistent/model",
                          *extra)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "/nonexistent/model" not in proc.stderr, proc.stderr

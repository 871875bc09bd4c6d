"""Data sources beyond single files (``posttrain.text_data``): a directory of data files, HF
``datasets`` ``save_to_disk`` directories (``Dataset`` and ``DatasetDict``), ``hf:`` sources
(a local dataset directory; no network), and ShareGPT conversations. Each is checked against the
same rows read from a plain JSON-lines file: the same token ids and loss masks (SFT), the same
prompts and columns (RL), through the real readers and a local tokenizer
(``tests/support/user_data.py``). Then the errors: each names the field, the value and the fix."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from engine_api.typed_config import check
from posttrain.text_data import DataConfig, PromptDataset, SFTDataset, load_tokenizer, parse_hf_source, read_rows, sharegpt_to_messages
from tests.support import user_data as ud

datasets = pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parents[2]
TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    ud.build_tokenizer(path)
    return load_tokenizer(str(path))


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """``load_dataset`` caches its Arrow copy under the test's directory, and never goes online."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _sft(files, tok, **kw) -> tuple[list, list]:
    """``(samples, sources)`` of train_files = ``files`` read as the recipes read them (config first, so sources expand)."""
    cfg = DataConfig(train_files=files, **kw)
    assert check(cfg, "data.") == []
    data = SFTDataset(cfg.train_files, tok, cfg, "data.train_files")
    return data.samples, data.sources


def _dd(rows_by_split: dict[str, list[dict]], path: Path) -> str:
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in rows_by_split.items()}).save_to_disk(str(path))
    return str(path)


def _problems(**kw) -> str:
    return "\n".join(check(DataConfig(**kw), "data."))


# ---------------------------------------------------------------------------------- sources equal their JSON lines
def test_a_directory_reads_its_data_files_directly_in_it_sorted(tok, tmp_path):
    rows = ud.message_rows(12, 0)
    want, _ = _sft(ud.write_rows(rows, tmp_path / "all.jsonl"), tok)
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    ud.write_rows(rows[5:], d / "part-b.jsonl")
    ud.write_rows(rows[:5], d / "part-a.jsonl")
    ud.write_rows(rows, d / "sub" / "nested.jsonl")  # not read: the directory is not walked
    ud.write_rows(rows, d / ".hidden.jsonl")  # not read
    (d / "README.md").write_text("notes\n")
    cfg = DataConfig(train_files=str(d))
    assert cfg.train_files == [str(d / "part-a.jsonl"), str(d / "part-b.jsonl")]  # the config holds what is read
    assert _sft(str(d), tok)[0] == want
    # read_rows expands a directory too (a config built without DataConfig)
    assert [r.values for r in read_rows([str(d)])] == [r.values for r in read_rows([str(tmp_path / "all.jsonl")])]


def test_a_directory_of_parquet_and_json_lines(tok, tmp_path):
    rows = ud.message_rows(9, 1)
    want, _ = _sft(ud.write_rows(rows, tmp_path / "all.jsonl"), tok)
    d = tmp_path / "mixed"
    d.mkdir()
    ud.write_rows(rows[:4], d / "a.parquet")
    ud.write_rows(rows[4:], d / "b.jsonl")
    assert _sft(str(d), tok)[0] == want


def test_a_saved_dataset_directory(tok, tmp_path):
    rows = ud.message_rows(10, 2)
    want, _ = _sft(ud.write_rows(rows, tmp_path / "all.jsonl"), tok)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    assert DataConfig(train_files=str(saved)).train_files == [str(saved)]  # read whole, with load_from_disk
    got, sources = _sft(str(saved), tok)
    assert got == want and sources[3] == f"{saved}[3]"


def test_a_saved_dataset_dict_gives_each_key_its_split(tok, tmp_path):
    train, val = ud.message_rows(10, 3), ud.message_rows(4, 4)
    dd = _dd({"train": train, "validation": val, "test": ud.message_rows(3, 5)}, tmp_path / "dd")
    cfg = DataConfig(train_files=dd, val_files=dd)
    assert check(cfg, "data.") == []
    got_train = SFTDataset(cfg.train_files, tok, cfg, "data.train_files")
    got_val = SFTDataset(cfg.val_files, tok, cfg, "data.val_files")
    assert got_train.samples == _sft(ud.write_rows(train, tmp_path / "t.jsonl"), tok)[0]
    assert got_val.samples == _sft(ud.write_rows(val, tmp_path / "v.jsonl"), tok)[0]
    assert got_val.sources[1] == f"{dd}[validation][1]"
    # data.val_split picks another split
    cfg = DataConfig(train_files=dd, val_files=dd, val_split="test")
    assert len(SFTDataset(cfg.val_files, tok, cfg, "data.val_files")) == 3


def test_an_hf_source_on_a_local_directory_with_split_files(tok, tmp_path):
    """``hf:DIR``: ``datasets.load_dataset`` splits the directory's files by name; RL prompts too."""
    train, val = ud.prompt_rows(12, 6), ud.prompt_rows(5, 7)
    d = tmp_path / "local_ds"
    d.mkdir()
    ud.write_rows(train, d / "train.jsonl")
    ud.write_rows(val, d / "validation.jsonl")
    (d / "README.md").write_text("---\nlicense: mit\n---\n# additions\n")
    entry = f"hf:{d}"
    cfg = DataConfig(train_files=entry, val_files=entry)
    assert cfg.train_files == [entry] and check(cfg, "data.") == []
    for key, rows in (("data.train_files", train), ("data.val_files", val)):
        got = PromptDataset([entry], tok, cfg, key)
        want = PromptDataset([ud.write_rows(rows, tmp_path / f"{key}.jsonl")], tok, cfg, key)
        assert [(s.ids.tolist(), s.text, s.columns) for s in got.samples] == [(s.ids.tolist(), s.text, s.columns) for s in want.samples]
    assert got.samples[2].source == f"{entry}[validation][2]"
    # SFT rows through hf: equal their JSON lines too (messages with keys other messages lack)
    msgs = ud.message_rows(9, 8)
    sft_dir = tmp_path / "sft_ds"
    sft_dir.mkdir()
    ud.write_rows(msgs, sft_dir / "data.jsonl")
    assert _sft(f"hf:{sft_dir}", tok)[0] == _sft(ud.write_rows(msgs, tmp_path / "m.jsonl"), tok)[0]
    assert parse_hf_source("hf:org/name:main") == ("org/name", "main") and parse_hf_source("hf:org/name") == ("org/name", None)


def test_dataset_rows_take_the_row_size_check(tok, tmp_path):
    saved = tmp_path / "big"
    datasets.Dataset.from_list([{"prompt": "1+1=", "answer": 2}, {"prompt": "x" * 5000, "answer": 1}]).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=rf"row {saved}\[1\] is about \d+ bytes of text, over data.max_row_bytes = 4096"):
        read_rows([str(saved)], max_row_bytes=4096)


# ---------------------------------------------------------------------------------- ShareGPT
def _sharegpt(rows: list[dict]) -> list[dict]:
    return [
        {"conversations": [{"from": TO_SHAREGPT[m["role"]], "value": m["content"]} for m in r["messages"]], "id": r["id"]} for r in rows
    ]


def test_sharegpt_rows_equal_the_same_conversation_as_messages(tok, tmp_path):
    rows = ud.message_rows(12, 9)
    want, _ = _sft(ud.write_rows(rows, tmp_path / "m.jsonl"), tok)
    shared = _sharegpt(rows)
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    got, _ = _sft(ud.write_rows(shared, tmp_path / "s.jsonl"), tok, format="sharegpt")  # messages_key null: `conversations`
    assert got == want
    # the other speaker spellings, in any case, from a Parquet file (one-turn rows: user, assistant)
    spellings = [("USER", "ChatGPT"), ("user", "bot"), ("human", "model"), ("Human", "assistant")]
    one_turn = [i for i, r in enumerate(rows) if len(r["messages"]) == 2]
    spelled = [
        {"conversations": [{"from": f, "value": m["content"]} for f, m in zip(spellings[k % 4], rows[i]["messages"], strict=True)]}
        for k, i in enumerate(one_turn)
    ]
    got, _ = _sft(ud.write_rows(spelled, tmp_path / "s.parquet"), tok, format="sharegpt")
    assert len(one_turn) >= 4 and got == [want[i] for i in one_turn]
    # another column, named explicitly
    renamed = [{"chat": s["conversations"]} for s in shared]
    assert _sft(ud.write_rows(renamed, tmp_path / "c.jsonl"), tok, format="sharegpt", messages_key="chat")[0] == want


def test_rl_prompts_as_sharegpt_turns_equal_messages(tok, tmp_path):
    rows = ud.prompt_rows(6, 10)
    as_msgs = [{**r, "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": r["prompt"]}]} for r in rows]
    as_turns = [{**r, "prompt": [{"from": "system", "value": "x"}, {"from": "human", "value": r["prompt"]}]} for r in rows]
    cfg = DataConfig()
    got, want = (PromptDataset([ud.write_rows(v, tmp_path / f"{n}.jsonl")], tok, cfg) for n, v in (("t", as_turns), ("m", as_msgs)))
    assert [(s.ids.tolist(), s.text, s.columns) for s in got.samples] == [(s.ids.tolist(), s.text, s.columns) for s in want.samples]


def test_sharegpt_turns_that_have_no_mapping_are_refused(tok, tmp_path):
    base = [{"from": "human", "value": "1+1="}, {"from": "gpt", "value": "2"}]
    for turn, match in (
        ({"from": "narrator", "value": "2"}, r"row .*bad\.jsonl:1: turn 1 has from = 'narrator', not a known speaker .*fix: rename"),
        (
            {"from": "observation", "value": "{}"},
            r"turn 1 has from = 'observation', a tool turn.*fix: give such rows as data\.format=messages",
        ),
        ({"from": "gpt", "value": "2", "weight": 0}, r"turn 1 has from = 'gpt' and weight = 0: per-turn loss weights are not read.*fix"),
        ({"from": "gpt", "value": None}, r"bad\.jsonl:1: message 1 \(assistant\) has content null"),
    ):
        path = ud.write_rows([{"conversations": [base[0], turn]}], tmp_path / "bad.jsonl")
        with pytest.raises(ValueError, match=match):
            SFTDataset([path], tok, DataConfig(format="sharegpt"))
    with pytest.raises(ValueError, match=r"expected a non-empty list of ShareGPT turns.*fix: check data.messages_key"):
        sharegpt_to_messages([{"role": "user", "content": "x"}], "r:1")
    # ShareGPT rows read as messages: the fix names data.format
    path = ud.write_rows([{"conversations": base}], tmp_path / "sg.jsonl")
    with pytest.raises(ValueError, match=r"no column 'messages' \(data\.messages_key\).*data\.format=sharegpt"):
        SFTDataset([path], tok, DataConfig())
    with pytest.raises(ValueError, match=r"ShareGPT turns are read with data\.format=sharegpt"):
        SFTDataset([path], tok, DataConfig(messages_key="conversations"))
    # data.format=sharegpt already set, a messages_key left pointing at `messages`: the fix names
    # that key, not the format the user already set
    with pytest.raises(ValueError, match=r"no column 'messages' \(data\.messages_key\).*fix: set data\.messages_key=conversations") as err:
        SFTDataset([path], tok, DataConfig(format="sharegpt", messages_key="messages"))
    assert "data.format=sharegpt" not in str(err.value)


@pytest.mark.parametrize("example", ["llama-3.2-1b-sft.yaml", "qwen2.5-0.5b-sft.yaml"])
def test_the_sft_examples_read_sharegpt_rows_with_the_format_alone(example, tok, tmp_path):
    """A user's ShareGPT file with an SFT example config: `data.format=sharegpt` is the one key
    to set (the examples leave messages_key to the format)."""
    from engine_api.typed_config import load_typed
    from recipes.sft import SFTConfig

    rows = ud.message_rows(4, 3)
    shared = ud.write_rows(_sharegpt(rows), tmp_path / "s.jsonl")
    overrides = ["data.format=sharegpt", f"data.train_files=[{shared}]", f"engine.model.path={tmp_path}"]
    data = load_typed(SFTConfig, f"configs/examples/{example}", overrides).data
    got, _ = _sft(shared, tok, format=data.format, messages_key=data.messages_key)
    assert got == _sft(ud.write_rows(rows, tmp_path / "m.jsonl"), tok)[0]


# ---------------------------------------------------------------------------------- errors
def test_directory_errors_name_the_path_the_extensions_and_the_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    problems = _problems(train_files=[str(empty)])
    assert f"data.train_files: the directory {str(empty)!r} holds no data file (.jsonl, .json, .parquet)" in problems and "fix:" in problems
    assert DataConfig(train_files=[str(empty)]).train_files == [str(empty)]  # kept, to be reported
    with pytest.raises(ValueError, match=r"data.val_files: the directory .*empty' holds no data file"):
        read_rows([str(empty)], "data.val_files")
    # an HF dataset directory (card + data/ files) given plainly: the fix points to hf:
    (tmp_path / "card" / "data").mkdir(parents=True)
    (tmp_path / "card" / "README.md").write_text("# x\n")
    assert f"give hf:{tmp_path / 'card'}" in _problems(train_files=[str(tmp_path / "card")])
    # files of two splits are not mixed into one training set
    split = tmp_path / "split"
    split.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        ud.write_rows(ud.message_rows(2, 0), split / name)
    problems = _problems(train_files=[str(split)])
    assert "holds files of several splits (test: test.jsonl; train: train.jsonl)" in problems and f"hf:{split}" in problems


def test_a_missing_split_names_the_splits_present_and_the_key(tok, tmp_path):
    dd = _dd({"train": ud.message_rows(3, 0), "test": ud.message_rows(2, 1)}, tmp_path / "dd")
    problems = _problems(train_files=[dd], val_files=[dd])
    assert f"data.val_files: {dd!r} has no split 'validation' (its splits: train, test); fix: set data.val_split to one of them" in problems
    # at data load too (a config built in Python), and for hf: sources
    with pytest.raises(ValueError, match=r"has no split 'validation' \(its splits: train, test\); fix: set data.val_split"):
        SFTDataset([dd], tok, DataConfig(), "data.val_files")
    d = tmp_path / "plain"
    d.mkdir()
    ud.write_rows(ud.message_rows(3, 0), d / "rows.jsonl")
    with pytest.raises(ValueError, match=rf"'hf:{d}' has no split 'dev' \(its splits: train\); fix: set data.train_split"):
        SFTDataset([f"hf:{d}"], tok, DataConfig(train_split="dev"))


def test_a_dataset_loading_script_is_refused_and_never_run(tok, tmp_path):
    marker = tmp_path / "ran"
    for name in ("script_ds", "other_script"):
        d = tmp_path / name
        d.mkdir()
        (d / ("script_ds.py" if name == "script_ds" else "build.py")).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        problems = _problems(train_files=[f"hf:{d}"])
        assert f"data.train_files: 'hf:{d}': {str(d)!r} holds a dataset loading script" in problems
        assert "loading scripts are never executed" in problems and "fix: convert the dataset to data files" in problems
        with pytest.raises(ValueError, match="loading scripts are never executed"):
            read_rows([f"hf:{d}"])
    # a script named after its directory is refused even beside data files (datasets 5 refuses it too)
    ud.write_rows(ud.message_rows(2, 0), tmp_path / "script_ds" / "train.jsonl")
    assert "holds a dataset loading script (script_ds.py);" in _problems(train_files=[f"hf:{tmp_path / 'script_ds'}"])
    # another .py beside data files is ignored by datasets, and not run
    ud.write_rows(ud.message_rows(2, 0), tmp_path / "other_script" / "train.jsonl")
    assert len(SFTDataset([f"hf:{tmp_path / 'other_script'}"], tok, DataConfig())) == 2
    assert not marker.exists()


def test_hf_sources_without_the_datasets_package(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "1+1="}]).save_to_disk(str(saved))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails, as when not installed
    for entry in ("hf:org/name", str(saved)):
        problems = _problems(train_files=[entry])
        assert f"data.train_files: {entry!r} is read with the `datasets` package, which is not installed" in problems
        assert "fix: pip install 'enginekit[datasets]'" in problems
        with pytest.raises(ValueError, match=r"the `datasets` package, which is not installed; fix: pip install"):
            read_rows([entry])
    assert "hf:./missing" in _problems(train_files=["hf:./missing"]) and "does not exist" in _problems(train_files=["hf:./missing"])
    assert "names no dataset" in _problems(train_files=["hf:"])


def test_the_module_does_not_import_datasets_when_imported():
    """Statically (a subprocess importing torch costs seconds): no import of ``datasets`` outside
    function bodies, so ``posttrain.text_data`` and the ``posttrain.data`` modules it re-exports
    load without the optional package (the test above runs the config checks and the readers with
    it blocked)."""
    files = [ROOT / "posttrain" / "text_data.py", *sorted((ROOT / "posttrain" / "data").glob("*.py"))]
    pending, eager = [node for path in files for node in ast.parse(path.read_text()).body], []
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            eager += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            eager.append(node.module or "")
        pending.extend(ast.iter_child_nodes(node))
    assert "torch" in eager and not [m for m in eager if m.split(".")[0] == "datasets"]


def test_a_tool_call_turn_is_never_trained_as_the_word_none(tok, tmp_path):
    """An assistant turn with content null and tool_calls, under a template that ignores
    tool_calls (it prints the content: Jinja writes None), is refused naming the row, in SFT rows
    and RL prompts alike; under a template that renders the calls, the call is what is trained."""
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    chat = [
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    path = ud.write_rows([{"messages": chat}], tmp_path / "calls.jsonl")
    refused = r"calls\.jsonl:1: message 1 \(assistant\) has content null and tool_calls \['add'\], but the chat template does not render"
    with pytest.raises(ValueError, match=refused):
        SFTDataset([path], tok, DataConfig())
    with pytest.raises(ValueError, match=r"message 1 \(assistant\) has content null and tool_calls"):
        PromptDataset([ud.write_rows([{"prompt": chat[:3]}], tmp_path / "p.jsonl")], tok, DataConfig())
    # A template that renders the calls: the call's text is the trained span of that turn.
    tok.chat_template = ud.TEMPLATE.replace(
        "{{ m['content'] }}",
        "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}{{ c['function']['name'] }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}",
    )
    try:
        ((ids, mask),) = SFTDataset([path], tok, DataConfig()).samples
    finally:
        tok.chat_template = ud.TEMPLATE
    assert "None" not in tok.decode(ids)
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained).startswith("???<|end|>")  # "add" (unknown chars), then the end of the turn

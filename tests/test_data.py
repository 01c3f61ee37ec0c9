"""Data: problem loaders (jsonl / parquet / datasets) and prompt rendering + tokenization
(reasoning-gym tasks: test_reasoning_gym.py)."""

import copy
import json
import logging

import pytest

from ngrpo_lightning.data import (
    DEFAULT_INSTRUCTION,
    Problem,
    PromptDataset,
    collate_prompts,
    load_problems,
    reasoning_gym_problems,
    render_prompt,
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    """The real SmolLM2 tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    from ngrpo_lightning.models.loading import cache_dir, load_tokenizer

    path = cache_dir() / "smollm2-135m-instruct"
    if (path / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer("tiny")  # builds the cached model once


def test_problem_is_dict_like():
    p = Problem("a", "What is 1 + 1?", "2")
    assert p["question"] == "What is 1 + 1?" and p.get("meta") == {} and p.get("nope", 7) == 7
    assert dict(p) == p.to_dict() == {"id": "a", "question": "What is 1 + 1?", "answer": "2", "meta": {}}
    with pytest.raises(KeyError):
        p["nope"]


# -------------------------------------------------------------------- loaders
RECORDS = [
    {"problem": "What is 2 + 2?", "answer": 4, "uid": "q1", "solution": "..."},
    {"problem": "Half of 1?", "answer": "\\frac{1}{2}", "uid": "q2", "solution": "..."},
    {"problem": "Pick one.", "answer": "B", "uid": "q3", "solution": "..."},
]


def _write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_round_trip(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", RECORDS[:2], extra_lines=["", json.dumps(RECORDS[2])])
    problems = load_problems(path)
    assert [p.question for p in problems] == [r["problem"] for r in RECORDS]
    assert [p.answer for p in problems] == ["4", "\\frac{1}{2}", "B"]  # answers are text
    assert [p.id for p in problems] == ["train-0", "train-1", "train-2"]
    assert problems[2].meta["source"].endswith("train.jsonl:4")  # the blank line still counts
    assert [p.id for p in load_problems(str(path), id_field="uid", limit=2)] == ["q1", "q2"]
    assert load_problems(path, limit=0) == []


def test_jsonl_custom_fields(tmp_path):
    path = _write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Q?", "final": 12.0}])
    (p,) = load_problems(path, problem_field="question", answer_field="final")
    assert (p.question, p.answer) == ("Q?", "12")


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "val.parquet"
    pq.write_table(pa.table({"problem": ["a?", "b?", "c?"], "answer": [0.5, 12.0, 3.0], "uid": [7, 8, 9]}), path)
    problems = load_problems(path, id_field="uid")
    assert [(p.id, p.question, p.answer) for p in problems] == [("7", "a?", "0.5"), ("8", "b?", "12"), ("9", "c?", "3")]
    assert len(load_problems(str(path), limit=2)) == 2


def write_verl_parquet(path, rows):
    """The N-GRPO release's layout: chat-message prompts, nested ground truths, extra columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "data_source": ["agentica-org/DeepScaleR-Preview-Dataset_train"] * len(rows),
                "prompt": [[{"role": "user", "content": q}] for q, _ in rows],
                "ability": ["math"] * len(rows),
                "reward_model": [{"style": "rule", "ground_truth": a} for _, a in rows],
                "extra_info": [{"split": "train", "index": i} for i in range(len(rows))],
            }
        ),
        path,
    )


def test_verl_parquet_layout_is_read_by_data_verl(tmp_path):
    from ngrpo_lightning.config import compose

    path = tmp_path / "train.parquet"
    instruction = "Let's think step by step and output the final answer within \\boxed{}"
    write_verl_parquet(path, [(f"What is 2+2? {instruction}", "4"), (f"Solve x+1=3. {instruction}", "2")])
    data = compose(["data=verl", f"data.train={path}"]).data
    problems = load_problems(path, data.problem_field, data.answer_field)
    assert [(p.question, p.answer) for p in problems] == [
        (f"What is 2+2? {instruction}", "4"),
        (f"Solve x+1=3. {instruction}", "2"),
    ]
    assert data.instruction == ""  # the release's prompts carry their instruction
    with pytest.raises(KeyError, match=r"'reward_model\.answer' \(data\.answer_field\) is missing"):
        load_problems(path, "prompt", "reward_model.answer")


# The shape of DeepSeek-R1-Distill's chat template: BOS, system text, user turns, and a generation
# prompt that opens the thinking (the real one is longer; it needs the hub to fetch).
R1_DISTILL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<\uff5cUser\uff5c>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<\uff5cAssistant\uff5c>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<\uff5cAssistant\uff5c><think>\\n' }}{% endif %}"
)


def test_verl_prompts_under_an_r1_distill_template_end_where_thinking_starts(tmp_path, tokenizer):
    """data=verl with the release's prompts: the instruction is not added a second time, and the
    prompt ends with the template's opening ``<think>`` so the policy starts inside its thinking."""
    import copy

    from ngrpo_lightning.build.data import build_datamodule
    from ngrpo_lightning.config import compose

    instruction = "Let's think step by step and output the final answer within \\boxed{}."
    write_verl_parquet(
        tmp_path / "t.parquet", [(f"What is 2+2? {instruction}", "4"), (f"What is 1+5? {instruction}", "6")]
    )
    cfg = compose(["data=verl", f"data.train={tmp_path / 't.parquet'}", f"data.val={tmp_path / 't.parquet'}"])
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = R1_DISTILL_TEMPLATE
    dm = build_datamodule(cfg, tok)
    dm.setup("fit")
    for item in dm.train_set.items:
        text = item["prompt_text"]
        assert text.endswith("<\uff5cAssistant\uff5c><think>\n"), text
        assert text.count("boxed") == 1 and text.count("Please reason") == 0, text  # one instruction
        assert tok.decode(item["prompt_ids"]).endswith("<think>\n")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", RECORDS[:2], extra_lines=['{"problem": "x", "answer": '])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_problems(path)


def test_missing_field_names_field_file_line_and_present_fields(tmp_path):
    path = _write_jsonl(tmp_path / "nofield.jsonl", [RECORDS[0], {"problem": "x", "solution": "y"}])
    with pytest.raises(KeyError) as err:
        load_problems(path)
    msg = str(err.value)
    assert "nofield.jsonl:2" in msg and "'answer'" in msg and "data.answer_field" in msg
    assert "['problem', 'solution']" in msg
    with pytest.raises(ValueError, match=r"field 'question' \(data\.problem_field\) is missing"):
        load_problems(path, problem_field="question")
    no_id = _write_jsonl(tmp_path / "noid.jsonl", [{"problem": "x", "answer": 1}])
    with pytest.raises(ValueError, match=r"noid\.jsonl:1: field 'uid' \(data\.id_field\) is missing"):
        load_problems(no_id, id_field="uid")


def test_parquet_missing_column_names_field_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["a?"], "answer": ["1"]}), path)
    with pytest.raises(KeyError, match=r"cols\.parquet.*'problem'.*\['answer', 'question'\]"):
        load_problems(path)


def test_missing_file_names_the_path(tmp_path):
    for name in ("nope.jsonl", "nope.parquet", "sub/dir/missing"):
        with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
            load_problems(tmp_path / name)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("problem,answer\n")
    with pytest.raises(ValueError, match=r"data\.csv.*'\.csv'.*\.jsonl.*\.parquet"):
        load_problems(path)


def test_dataset_directories(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    records = [{**r, "answer": str(r["answer"])} for r in RECORDS]  # one type per column
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:1])}
    ).save_to_disk(saved)
    assert [p.answer for p in load_problems(saved)] == ["4", "\\frac{1}{2}", "B"]
    assert [p.id for p in load_problems(saved, split="test", id_field="uid")] == ["q1"]
    with pytest.raises(ValueError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_problems(saved, split="validation")

    files = tmp_path / "files"
    files.mkdir()
    _write_jsonl(files / "part.jsonl", RECORDS)
    problems = load_problems(files, limit=2)
    assert [p.question for p in problems] == [r["problem"] for r in RECORDS[:2]] and problems[0].id == "files-0"


# -------------------------------------------------------------------- prompts
def test_render_prompt_uses_chat_template(chat_tokenizer):
    text = render_prompt(chat_tokenizer, "What is 2 + 3?")
    assert "What is 2 + 3?\n" + DEFAULT_INSTRUCTION in text
    assert DEFAULT_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
    assert text.endswith("<|im_start|>assistant\n")  # generation prompt: the model answers next
    custom = render_prompt(chat_tokenizer, "Q?", instruction="Answer briefly.", system_prompt="You are terse.")
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in custom and "Q?\nAnswer briefly." in custom
    assert "Please reason" not in custom
    assert "Q?<|im_end|>" in render_prompt(chat_tokenizer, "Q?", instruction="")


def test_render_prompt_without_chat_template(chat_tokenizer):
    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = None
    assert render_prompt(plain, "What is 2 + 3?") == f"What is 2 + 3?\n{DEFAULT_INSTRUCTION}\n"


def test_prompt_dataset_items_and_tokens(chat_tokenizer):
    problems = reasoning_gym_problems(["chain_sum"], 6, seed=0)
    ds = PromptDataset(problems, chat_tokenizer, max_prompt_tokens=4096)
    assert len(ds) == 6 and ds.num_dropped == 0
    item = ds[0]
    assert set(item) == {"id", "prompt_ids", "prompt_text", "answer", "verifier"}
    assert item["verifier"] == problems[0].meta["verifier"]
    assert (item["id"], item["answer"]) == (problems[0].id, problems[0].answer)
    assert item["prompt_text"] == render_prompt(chat_tokenizer, problems[0].question)
    assert item["prompt_ids"] == chat_tokenizer(item["prompt_text"], add_special_tokens=False)["input_ids"]
    bos = chat_tokenizer.bos_token_id
    assert item["prompt_ids"][:2] != [bos, bos]  # no special token added twice
    assert chat_tokenizer.decode(item["prompt_ids"]) == item["prompt_text"]


def test_prompt_dataset_drops_long_prompts(chat_tokenizer, caplog):
    short = Problem("s", "What is 1 + 1?", "2")
    long = Problem("l", "What is " + " + ".join(["1"] * 300) + "?", "300")
    limit = len(PromptDataset([short], chat_tokenizer)[0]["prompt_ids"]) + 5
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset([short, long, short], chat_tokenizer, max_prompt_tokens=limit)
    assert ds.num_dropped == 1 and len(ds) == 2 and [it["id"] for it in ds] == ["s", "s"]
    assert f"dropped 1 of 3 prompts longer than {limit} tokens" in caplog.text
    with pytest.raises(ValueError, match=r"all 1 prompts are longer than data\.max_prompt_tokens"):
        PromptDataset([long], chat_tokenizer, max_prompt_tokens=limit)
    with pytest.raises(ValueError, match=r"data\.max_prompt_tokens must be a positive integer"):
        PromptDataset([short], chat_tokenizer, max_prompt_tokens=0)


def test_collate_prompts_keeps_lists_unpadded(chat_tokenizer):
    ds = PromptDataset(
        [Problem("a", "What is 1 + 1?", "2"), Problem("b", "What is 12 * 12 - 7?", "137")], chat_tokenizer
    )
    batch = collate_prompts([ds[0], ds[1]])
    assert batch["id"] == ["a", "b"] and batch["answer"] == ["2", "137"] and batch["verifier"] == [None, None]
    assert [len(ids) for ids in batch["prompt_ids"]] == [len(ds[0]["prompt_ids"]), len(ds[1]["prompt_ids"])]
    assert len(batch["prompt_ids"][0]) != len(batch["prompt_ids"][1])  # ragged: the engine pads
    assert collate_prompts([]) == {"id": [], "prompt_ids": [], "prompt_text": [], "answer": [], "verifier": []}

"""The embedded default model is written with its tokenizer: a daemon started without --model serves
a directory that has tokenizer.json and tokenizer_config.json beside config.json, and the two agree
(vocabulary size 8192; the model's bos and eos ids are the tokenizer's <|begin_of_text|> and
<|endoftext|>). Read with Hugging Face `tokenizers` when it is installed, else as plain JSON."""
import json
import pathlib


def test_default_model_dir_has_its_tokenizer(rolloutd):
    d = rolloutd()
    model_dir = pathlib.Path(d.get("/get_model_info").json()["model_path"])
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = dict(tok_json["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in tok_json["added_tokens"]})
    assert len(set(ids.values())) == cfg["vocab_size"] == 8192
    assert max(ids.values()) == 8191
    assert ids[tok_cfg["eos_token"]] == cfg["eos_token_id"] == ids["<|endoftext|>"]
    assert ids[tok_cfg["bos_token"]] == cfg["bos_token_id"] == ids["<|begin_of_text|>"]
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    t = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert t.get_vocab_size() == 8192
    assert t.decode(t.encode("Hello, world! 你好").ids) == "Hello, world! 你好"

"""transformers' side of tests/tokenize/ (`accrue tokenize`).

    tokenize_ref.py gpt2-ids GPT2_DIR TEXT_FILE
        GPT2TokenizerFast.from_pretrained(GPT2_DIR) (vocab.json and
        merges.txt as `accrue tokenize --dump-gpt2-files` writes them): the
        ids of the file's text, as a JSON list on stdout.
    tokenize_ref.py decode TOKENIZER_DIR IDS_JSON OUT_AUTO OUT_FAST
        The ids decoded by AutoTokenizer.from_pretrained(TOKENIZER_DIR) and
        by PreTrainedTokenizerFast(tokenizer_file=TOKENIZER_DIR/tokenizer.json),
        written (UTF-8) to OUT_AUTO and OUT_FAST.
    tokenize_ref.py parquet JSON_IN OUT [COMPRESSION]
        The JSON list of objects in JSON_IN written by pyarrow as a Parquet
        table (what `datasets` and the Hub store), with COMPRESSION (default
        snappy, pyarrow's).
    tokenize_ref.py saved-dataset JSON_IN OUT_DIR
        The JSON list of objects in JSON_IN as `datasets.save_to_disk`
        lays a dataset out: two Arrow IPC stream files
        (data-0000i-of-00002.arrow, written by pyarrow's stream writer as
        datasets' ArrowWriter does), state.json and dataset_info.json.
    tokenize_ref.py chat MODEL_DIR ROWS_JSON
        Each row's `messages` through AutoTokenizer.from_pretrained(MODEL_DIR)
        .apply_chat_template(tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True) when the template has
        {% generation %} blocks; otherwise the ids of the rendering and, as
        the mask, the tokens each assistant turn adds to the rendering of the
        turns before it with the generation prompt (char_to_token of its
        first and last characters). A JSON list of {ids, mask} on stdout.
    tokenize_ref.py safetensors FILE
        The file read by the `safetensors` package (numpy): its metadata and
        each tensor's dtype, shape and values, as JSON on stdout.

Offline: nothing is downloaded.
"""
import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"



def main():
    cmd = sys.argv[1]
    if cmd in ("gpt2-ids", "decode"):
        from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast
    if cmd == "gpt2-ids":
        tok = GPT2TokenizerFast.from_pretrained(sys.argv[2])
        assert len(tok) == 50257, f"GPT-2 vocabulary of {len(tok)}"
        with open(sys.argv[3], encoding="utf-8", newline="") as f:
            text = f.read()
        print(json.dumps(tok(text)["input_ids"]))
    elif cmd == "decode":
        folder, ids_file, out_auto, out_fast = sys.argv[2:6]
        with open(ids_file) as f:
            ids = json.load(f)
        auto = AutoTokenizer.from_pretrained(folder)
        fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
        for tok, out in ((auto, out_auto), (fast, out_fast)):
            text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            with open(out, "w", encoding="utf-8", newline="") as f:
                f.write(text)
    elif cmd == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with open(sys.argv[2]) as f:
            rows = json.load(f)
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, sys.argv[3],
                       compression=sys.argv[4] if len(sys.argv) > 4 else "snappy",
                       row_group_size=3)
    elif cmd == "saved-dataset":
        import pyarrow as pa

        with open(sys.argv[2]) as f:
            rows = json.load(f)
        out = sys.argv[3]
        os.makedirs(out, exist_ok=True)
        table = pa.Table.from_pylist(rows)
        half = (len(rows) + 1) // 2
        files = []
        for i, part in enumerate([table.slice(0, half), table.slice(half)]):
            name = f"data-{i:05d}-of-00002.arrow"
            with pa.ipc.new_stream(os.path.join(out, name), table.schema) as w:
                w.write_table(part, max_chunksize=2)
            files.append({"filename": name})
        with open(os.path.join(out, "state.json"), "w") as f:
            json.dump({"_data_files": files, "_format_type": None, "_split": None}, f)
        with open(os.path.join(out, "dataset_info.json"), "w") as f:
            json.dump({"features": {k: {"dtype": "string", "_type": "Value"}
                                    for k in table.column_names}}, f)
    elif cmd == "chat":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(sys.argv[2])
        with open(sys.argv[3]) as f:
            rows = json.load(f)
        markers = "{% generation %}" in tok.chat_template or "{%- generation" in tok.chat_template
        out = []
        for messages in rows:
            if markers:
                r = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
                out.append({"ids": list(r["input_ids"]), "mask": list(r["assistant_masks"])})
                continue
            text = tok.apply_chat_template(messages, tokenize=False)
            enc = tok(text, add_special_tokens=False)
            ids = enc["input_ids"]
            mask = [0] * len(ids)
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = tok.apply_chat_template(messages[:i], tokenize=False,
                                                 add_generation_prompt=True)
                upto = tok.apply_chat_template(messages[:i + 1], tokenize=False)
                start, end = len(before), len(upto)
                first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
                if first is None:
                    continue
                for t in range(first, last + 1 if last else len(ids)):
                    mask[t] = 1
            out.append({"ids": ids, "mask": mask})
        print(json.dumps(out))
    elif cmd == "safetensors":
        from safetensors import safe_open

        out = {}
        with safe_open(sys.argv[2], framework="numpy") as f:
            out["__metadata__"] = f.metadata()
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist()}
        print(json.dumps(out))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()

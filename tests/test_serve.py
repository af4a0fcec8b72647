"""``hf-relpos serve``: Transformers' OpenAI-compatible server over an hf_relpos folder, driven by a real HTTP client.

Two tiny random folders (a decoder-only one with a learned position table of 64 and a chat template; an
encoder-decoder without one), each served by ``python -m hf_relpos.cli serve`` in a subprocess bound to 127.0.0.1 on
a free port (``--port 0``), started once per module and always stopped here (SIGINT, then a kill after a timeout).
Every answer is compared with ``model.generate`` on the same prompt in this process.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="hf-relpos serve needs the serve extra (fastapi, uvicorn, openai)")
pytest.importorskip("uvicorn", reason="hf-relpos serve needs the serve extra (fastapi, uvicorn, openai)")
pytest.importorskip("openai", reason="hf-relpos serve needs the serve extra (fastapi, uvicorn, openai)")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import hf_relpos_cli  # noqa: E402
from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForConditionalGeneration  # noqa: E402
from hf_relpos.commands.common import load_folder  # noqa: E402
from hf_relpos.data import embedded_corpus, train_tokenizer  # noqa: E402

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_serve")

torch.set_num_threads(1)

TABLE = 64  # the decoder-only folder's learned position table
# Transformers 5.25's server: the model runs in a process of its own (hf_relpos.commands.serve_app)
ENGINE_SERVER = hasattr(importlib.import_module("transformers.cli.serving.model_manager"), "ModelLoader")
SHORT = 8  # the encoder-decoder's max_position_embeddings, a field its relative scheme does not read
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["The for statement", "def f(x):", "import os", "A list is", "while True", "class A", "x = [1, 2]",
           "print(", "The module", "Return the", "If the", "lambda", "try:", "yield", "with open", "An iterator"]
START_TIMEOUT = 120  # seconds for a server to load and bind (imports torch and Transformers on a busy 2-core CI)
REQUEST_TIMEOUT = 60


def _tokenizer():
    return train_tokenizer([embedded_corpus()["train"][:20000]], vocab_size=300)


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tokenizer = _tokenizer()
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=len(tokenizer), initializer_range=0.3, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    causal = RelPosForCausalLM(RelPosConfig(position_encoding="learned", max_position_embeddings=TABLE, **sizes))
    tokenizer.chat_template = CHAT_TEMPLATE
    decoder = _save(causal, tokenizer, root / "decoder")
    tokenizer.chat_template = None
    torch.manual_seed(1)
    # max_position_embeddings: a field t5_bias does not use (Transformers 5.25's server refuses prompts past it)
    seq2seq = RelPosForConditionalGeneration(RelPosConfig(
        position_encoding="t5_bias", is_encoder_decoder=True, num_decoder_layers=2, max_position_embeddings=SHORT,
        decoder_start_token_id=tokenizer.pad_token_id, **sizes))
    return {"decoder": decoder, "seq2seq": _save(seq2seq, tokenizer, root / "seq2seq")}


class Server:
    """``hf-relpos serve FOLDER --port 0`` in a subprocess; ``url`` once it printed where it listens."""

    def __init__(self, folder: Path, log_dir: Path, *extra: str):
        self.out, self.err = log_dir / f"{folder.name}.out", log_dir / f"{folder.name}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hf_relpos.cli", "serve", str(folder), "--host", "127.0.0.1", "--port", "0",
                 "--max-tokens", "32", *extra],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                # a shell that started the tests in the background left SIGINT ignored: the server must get it
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        self.url = None

    def wait(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            text = self.out.read_text()
            if "http://" in text:
                self.url = text.split("http://", 1)[1].split()[0].rsplit("/v1", 1)[0]
                self.url = "http://" + self.url
                self.port = int(self.url.rsplit(":", 1)[1])
                return self
            if self.process.poll() is not None:
                pytest.fail(f"the server exited ({self.process.returncode}): {self.err.read_text()[-2000:]}")
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"the server did not start in {START_TIMEOUT} s: {self.err.read_text()[-2000:]}")

    def stop(self, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def request(server: Server, path: str, body=None, raw: bytes | None = None):
    """(status, parsed JSON or the SSE text) of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    if text.startswith("data:"):
        return status, text
    return status, json.loads(text)


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    started = {name: Server(folder, logs) for name, folder in folders.items()}
    try:
        yield {name: server.wait() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def references(folders):
    """``model.generate`` (greedy) on each folder's model as the server loads it, with the server's eos and pad."""
    loaded = {}
    for name, folder in folders.items():
        model, tokenizer = load_folder(str(folder), encoder_decoder=True)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            decoder_start_token_id=model.config.decoder_start_token_id if model.config.is_encoder_decoder else None)
        loaded[name] = (model, tokenizer)

    def generate(name: str, prompt=None, max_new_tokens: int = 8, ids=None):
        model, tokenizer = loaded[name]
        inputs = tokenizer(prompt, return_tensors="pt") if ids is None else {"input_ids": torch.tensor([ids])}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        start = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]  # after the start token
        return tokenizer.decode(out[0, start:], skip_special_tokens=True), out.shape[1] - start

    generate.tokenizers = {name: tokenizer for name, (_, tokenizer) in loaded.items()}
    return generate


def completion(server, prompt, max_tokens=8, **extra):
    return request(server, "/v1/completions", {"model": Path(server.out).stem, "prompt": prompt,
                                               "max_tokens": max_tokens, "temperature": 0} | extra)


@pytest.mark.parametrize("name", ["decoder", "seq2seq"])
def test_completions_equal_generate_and_stream_the_same_text(servers, references, name):
    server = servers[name]
    for prompt in PROMPTS[:3]:
        status, answer = completion(server, prompt)
        assert status == 200, answer
        expected, generated = references(name, prompt)
        assert answer["choices"][0]["text"] == expected
        assert answer["usage"]["completion_tokens"] == generated
        assert answer["model"].startswith(name)
    status, sse = completion(server, PROMPTS[0], stream=True)
    assert status == 200
    chunks = [json.loads(line[len("data: "):]) for line in sse.splitlines() if line.startswith("data: {")]
    # the usage comes in a closing chunk (Transformers 5.25: one without choices), asked for or not
    streamed, (expected, generated) = "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), references(
        name, PROMPTS[0])
    # Transformers' stream decodes token by token (tokenizers' DecodeStream), which holds back the bytes of a
    # character not yet complete: a random model's answer may end inside one, which decode() shows as U+FFFD.
    assert expected.startswith(streamed) and set(expected[len(streamed):]) <= {"\ufffd"}, (streamed, expected)
    assert len(streamed) >= len(expected.rstrip("\ufffd")) and chunks[-1]["usage"]["completion_tokens"] == generated


def test_stop_strings_end_the_answer(servers, references):
    """``stop`` reaches generate's ``stop_strings`` (with the tokenizer): the answer ends where the stop string is
    first produced, a prefix of the free answer."""
    server = servers["decoder"]
    status, free = completion(server, PROMPTS[1], max_tokens=12)
    assert status == 200, free
    text = free["choices"][0]["text"]
    # A random model's text: the first plain character that first appears after the start and before the end.
    stop = next((c for i, c in enumerate(text) if 0 < i < len(text) - 2 and c.isprintable() and c != "\ufffd"
                 and text.index(c) == i), None)
    assert stop is not None, text
    end = text.index(stop) + len(stop)
    status, stopped = completion(server, PROMPTS[1], max_tokens=12, stop=[stop])
    assert status == 200, stopped
    got = stopped["choices"][0]["text"]
    assert text.startswith(got) and text[:end].startswith(got.rstrip()) and len(got) >= text.index(stop), (got, text)
    assert stopped["usage"]["completion_tokens"] < free["usage"]["completion_tokens"]


def test_an_encoder_decoder_answers_with_its_decoder_output_not_the_prompt_cut(servers, references):
    """Transformers cuts the prompt's length off generate's output, as for a decoder-only model: for an
    encoder-decoder that dropped the first tokens of the answer (or all of them)."""
    prompt = "The module defines a class for each kind of statement"  # longer than the answer
    status, answer = completion(servers["seq2seq"], prompt, max_tokens=6)
    expected, generated = references("seq2seq", prompt, max_new_tokens=6)
    assert status == 200 and generated > 0
    assert answer["choices"][0]["text"] == expected and answer["usage"]["completion_tokens"] == generated


def test_a_relative_scheme_is_not_held_to_max_position_embeddings(servers, references):
    """t5_bias has no position table: a prompt and an answer longer than the config's max_position_embeddings are
    served (Transformers 5.25 alone refuses a prompt of max_position_embeddings tokens or more)."""
    prompt = " ".join(PROMPTS)
    assert len(references.tokenizers["seq2seq"](prompt)["input_ids"]) > 4 * SHORT
    status, answer = completion(servers["seq2seq"], prompt, max_tokens=2 * SHORT)
    expected, generated = references("seq2seq", prompt, max_new_tokens=2 * SHORT)
    assert status == 200 and answer["choices"][0]["text"] == expected, answer
    assert answer["usage"] == {"prompt_tokens": answer["usage"]["prompt_tokens"], "completion_tokens": generated,
                               "total_tokens": answer["usage"]["prompt_tokens"] + generated}
    assert answer["usage"]["prompt_tokens"] > 4 * SHORT


@pytest.mark.skipif(not ENGINE_SERVER, reason="Transformers 5.25's server (its model process) only")
def test_an_encoder_decoders_table_bounds_its_prompt_alone_on_the_engine_server():
    """5.25's server bounds prompt and answer together by the context length: an encoder-decoder's prompt of its
    whole table was refused there (served on 5.21-5.24), with a message naming --max-model-len."""
    from hf_relpos.commands.serve_app import FolderGenerationState

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50,
                 max_position_embeddings=16)
    state = FolderGenerationState()
    assert state.context_length(RelPosConfig(position_encoding="learned", is_encoder_decoder=True, **sizes)) is None
    assert state.context_length(RelPosConfig(position_encoding="learned", **sizes)) == 16
    assert state.context_length(RelPosConfig(position_encoding="alibi", **sizes)) is None


def peak_rss_mib(pid: int) -> dict:
    """The peak resident memory (VmHWM, MiB) of a process and of every process under it (5.25: the model process),
    by pid."""
    peaks, pending = {}, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            peaks[current] = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return peaks


def test_sixteen_concurrent_clients_each_get_their_own_answer(servers, references):
    server = servers["decoder"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: completion(server, p, max_tokens=6), PROMPTS))
    for prompt, (status, answer) in zip(PROMPTS, answers):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == references("decoder", prompt, max_new_tokens=6)[0], prompt


def test_malformed_requests_get_a_4xx_json_error_and_serving_goes_on(servers, references):
    server = servers["decoder"]
    long_prompt = " ".join(["statement"] * TABLE)
    bad = [
        (None, b"{not json", 400, None),
        (None, b"[1, 2]", 400, None),
        ({"model": "another", "prompt": "x"}, None, 404, "model"),
        ({"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": "8"}, None, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 33}, None, 400, "max_tokens"),  # over --max-tokens 32
        ({"prompt": long_prompt, "max_tokens": 4}, None, 400, "prompt"),  # past the learned table of 64
        ({"prompt": "The for statement", "max_tokens": 32, "stop": 5}, None, 400, "stop"),
        ({"prompt": ["a", "b"]}, None, 400, "prompt"),
        ({"prompt": ""}, None, 400, "prompt"),
        ({"prompt": "x", "temperature": -1}, None, 400, "temperature"),
        ({"prompt": "x", "stream": "yes"}, None, 400, "stream"),
        ({"prompt": "x", "no_such_field": 1}, None, 422, None),
        # OpenAI's fields Transformers' handlers ignore: answered 200 as if absent before (one choice for n=2)
        ({"prompt": "x", "n": 2}, None, 400, "n"),
        ({"prompt": "x", "logprobs": 2}, None, 400, "logprobs"),
        ({"prompt": "x", "echo": True}, None, 400, "echo"),
        ({"prompt": "x", "best_of": 3}, None, 400, "best_of"),
        ({"prompt": "x", "logit_bias": {"5": 100}}, None, 400, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 1}, None, 400, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -1}, None, 400, "frequency_penalty"),  # a 500 from generate before
        ({"prompt": "x", "stream": True, "stream_options": "x"}, None, 400, "stream_options"),  # a 500 on 5.25
        ({"prompt": "x", "stop": ""}, None, 400, "stop"),  # stopped after one token
    ]
    expected = references("decoder", "import os", max_new_tokens=4)[0]
    for body, raw, status, param in bad:
        got, answer = request(server, "/v1/completions", body, raw=raw)
        assert got == status, (body or raw, answer)
        assert set(answer) == {"error"} and answer["error"]["message"], answer
        assert answer["error"]["type"] == "invalid_request_error"
        if param:
            assert answer["error"]["param"] == param, answer
        ok, good = completion(server, "import os", max_tokens=4)
        assert ok == 200 and good["choices"][0]["text"] == expected, (body or raw, good)
    # a prompt whose answer would run past the table: 400 when max_tokens asks for it, cut to the table without
    ids = references.tokenizers["decoder"](long_prompt)["input_ids"][: TABLE - 3]
    prompt = references.tokenizers["decoder"].decode(ids)
    n = len(references.tokenizers["decoder"](prompt)["input_ids"])
    assert request(server, "/v1/completions", {"prompt": prompt, "max_tokens": TABLE - n + 1})[0] == 400
    status, answer = request(server, "/v1/completions", {"prompt": prompt, "temperature": 0})
    assert status == 200 and answer["choices"][0]["text"] == references("decoder", prompt, TABLE - n)[0]
    assert request(servers["decoder"], "/v1/responses", {"input": "x"})[0] == 404


def test_models_and_health(servers):
    for name, server in servers.items():
        assert request(server, "/health") == (200, {"status": "ok"})
        status, models = request(server, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [name]
        # the name an answer carries ("NAME@main", Transformers') is taken back (a 404 before)
        status, answer = completion(server, "import os", max_tokens=2)
        again = completion(server, "import os", max_tokens=2, model=answer["model"])
        assert status == 200 and again[0] == 200, (answer, again)


def test_chat_completions_with_a_template_and_a_clear_4xx_without(servers, references):
    messages = [{"role": "user", "content": "What does the for statement do?"}]
    status, answer = request(servers["decoder"], "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert status == 200, answer
    tokenizer = references.tokenizers["decoder"]
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = references("decoder", ids=ids["input_ids"], max_new_tokens=6)[0]
    assert answer["choices"][0]["message"]["content"] == expected
    status, answer = request(servers["seq2seq"], "/v1/chat/completions", {"messages": messages})
    assert status == 400 and answer["error"]["code"] == "no_chat_template", answer
    status, answer = request(servers["decoder"], "/v1/chat/completions", {"messages": "hello"})
    assert status == 400 and answer["error"]["param"] == "messages"
    for kwargs in ("str", {"add_generation_prompt": False}, {"tokenize": False}):  # 500s before
        status, answer = request(servers["decoder"], "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 4, "chat_template_kwargs": kwargs})
        assert status == 400 and answer["error"]["param"] == "chat_template_kwargs", answer
    long = [{"role": "user", "content": " ".join(["statement"] * TABLE)}]  # past the learned table
    status, answer = request(servers["decoder"], "/v1/chat/completions", {"messages": long, "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "messages", answer  # was "prompt", a field chat has not


def test_continuous_batching_answers_sixteen_concurrent_clients_as_generate(folders, references, tmp_path):
    """--continuous-batching: Transformers' paged-cache manager runs the requests packed together; each answer (plain
    and streamed) is still the one greedy generate gives that prompt alone; the server's memory stays far below the
    machine's."""
    server = Server(folders["decoder"], tmp_path, "--continuous-batching", "--cb-block-size", "16").wait()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda p: completion(server, p, max_tokens=6), PROMPTS))
        for prompt, (status, answer) in zip(PROMPTS, answers):
            assert status == 200, answer
            assert answer["choices"][0]["text"] == references("decoder", prompt, max_new_tokens=6)[0], prompt
        status, sse = completion(server, PROMPTS[1], max_tokens=6, stream=True)
        chunks = [json.loads(line[len("data: "):]) for line in sse.splitlines() if line.startswith("data: {")]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        expected = references("decoder", PROMPTS[1], 6)[0]
        assert status == 200 and expected.startswith(streamed) and set(expected[len(streamed):]) <= {"\ufffd"}
        if ENGINE_SERVER:
            # 5.25: each request samples with its own settings, and the greedy ones beside them stay greedy
            def ask(i):
                extra = dict(temperature=1.5, top_p=0.9, seed=i) if i % 2 else {}
                return completion(server, PROMPTS[i], max_tokens=6, **extra)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(ask, range(16)))
            sampled_differ = 0
            for i, (status, answer) in enumerate(answers):
                assert status == 200, answer
                greedy = references("decoder", PROMPTS[i], max_new_tokens=6)[0]
                if i % 2:
                    sampled_differ += answer["choices"][0]["text"] != greedy
                else:
                    assert answer["choices"][0]["text"] == greedy, PROMPTS[i]
            assert sampled_differ >= 4, answers  # temperature 1.5 over a random model's 6 tokens: rarely the argmax
            refused = (("frequency_penalty", 0.5),)
        else:
            # 5.21-5.24: one generation config serves every request (the first one's): sampling is refused
            refused = (("temperature", 1.0), ("top_p", 0.5), ("frequency_penalty", 0.5))
        for field, value in refused:
            status, answer = completion(server, PROMPTS[2], max_tokens=6, **{field: value})
            assert status == 400 and answer["error"]["param"] == field, answer
        status, answer = completion(server, PROMPTS[2], max_tokens=6)
        assert status == 200 and answer["choices"][0]["text"] == references("decoder", PROMPTS[2], 6)[0]
        assert request(server, "/health") == (200, {"status": "ok"})
        # the paged cache sized for 8 requests of the 64-position table (before: 60-90% of the machine's memory,
        # 14 GB on a 24 GB machine); each process (on 5.25 the server and its model process, each with torch and
        # Transformers imported: ~0.5 GiB) far below it
        peaks = peak_rss_mib(server.process.pid)
        assert peaks and max(peaks.values()) < 1024, f"serving peaked at {peaks} MiB"
    finally:
        assert server.stop() == 0, server.err.read_text()[-2000:]


def test_sigint_stops_the_server_cleanly(servers):
    """Last in the file: it stops the module's servers. Exit 0, the port free again, no traceback."""
    for server in servers.values():
        started = time.monotonic()
        assert server.stop() == 0, server.err.read_text()[-2000:]
        assert time.monotonic() - started < 15
        err = server.err.read_text()
        assert "Traceback" not in err and "stopped" in err, err[-2000:]
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(("127.0.0.1", server.port))  # nothing listens there now
        with socket.socket() as sock:  # and a new server can bind it (its old connections may be in TIME_WAIT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", server.port))


def test_sigterm_with_requests_in_flight_answers_them_and_exits_cleanly(folders, tmp_path):
    """SIGTERM (as Ctrl-C) while a plain and a streamed request are in flight: each ends cleanly, exit 0, no
    traceback. A request generating is answered (cut where the graceful shutdown ends); on Transformers 5.25, whose
    model process runs one request at a time, the one still waiting gets a 503 or a stream error event, never a cut
    connection. Before: uvicorn re-raised SIGTERM (exit -15, no cleanup), and a request past the graceful wait was
    cancelled with a traceback while its generate ran on in its thread."""
    server = Server(folders["seq2seq"], tmp_path, "--max-tokens", "100000").wait()
    answers, started = {}, time.monotonic()

    def ask(stream):
        answers[stream] = completion(server, PROMPTS[0], max_tokens=100000, stream=stream)

    clients = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    try:
        for client in clients:
            client.start()
        time.sleep(1)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0, server.err.read_text()[-2000:]
        for client in clients:
            client.join(REQUEST_TIMEOUT)
    finally:
        server.stop()
    err = server.err.read_text()
    assert "Traceback" not in err and "stopped" in err, err[-2000:]
    assert time.monotonic() - started < 30
    generated = []
    status, answer = answers[False]
    if status == 200:
        generated.append(answer["usage"]["completion_tokens"])
    else:
        assert status == 503 and "stopped" in answer["error"]["message"], answer
    status, sse = answers[True]
    last = json.loads(sse.rstrip().splitlines()[-1][len("data: "):])  # the stream's closing chunk came
    assert status == 200, sse
    if "error" in last:
        assert "stopped" in last["error"], last
    else:
        assert last["usage"]["completion_tokens"] > 0, last
        generated.append(last["usage"]["completion_tokens"])
    assert generated and all(0 < n < 100000 for n in generated), answers


def test_not_a_model_folder_is_one_line_before_binding(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert hf_relpos_cli.main(["serve", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-relpos serve: error: ") and "relpos" in err and "\n" not in err
    with pytest.raises(SystemExit) as stop:
        hf_relpos_cli.main(["serve", str(tmp_path), "--port", "70000"])
    assert stop.value.code == 2 and "--port" in capsys.readouterr().err
    assert hf_relpos_cli.main(["serve", str(tmp_path), "--cb-num-blocks", "8"]) == 2
    assert "--cb-num-blocks" in capsys.readouterr().err
    assert hf_relpos_cli.main(["serve", str(tmp_path), "--device", "no-such-device"]) == 2
    assert "--device 'no-such-device'" in capsys.readouterr().err


def test_a_taken_port_is_one_line(folders, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert hf_relpos_cli.main(["serve", str(folders["decoder"]), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-relpos serve: error: --port") and "in use" in err and "\n" not in err


def test_continuous_batching_refuses_an_encoder_decoder_and_transformer_xl_memory(folders, tmp_path, capsys):
    assert hf_relpos_cli.main(["serve", str(folders["seq2seq"]), "--continuous-batching"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--continuous-batching" in err and "encoder-decoder" in err and "\n" not in err
    tokenizer = _tokenizer()
    config = RelPosConfig(position_encoding="transformer_xl", mem_len=8, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=4, vocab_size=len(tokenizer))
    folder = _save(RelPosForCausalLM(config), tokenizer, tmp_path / "txl")
    capsys.readouterr()  # save_pretrained's progress bar
    assert hf_relpos_cli.main(["serve", str(folder), "--continuous-batching"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--continuous-batching" in err and "mem_len=8" in err and "\n" not in err


def test_a_reachable_host_is_warned_of():
    """--host other than a loopback address: a warning that the server has no authentication (not bound here: the
    tests listen on 127.0.0.1 only)."""
    from hf_relpos.commands.serve import exposure_warning

    for host in ("127.0.0.1", "::1", "127.0.0.2"):
        assert exposure_warning(host) is None
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        assert "no authentication" in exposure_warning(host) and host in exposure_warning(host)

"""Downloads, end to end against a real HTTP server on 127.0.0.1 (no network, no mock of urllib): sources that
refuse, redirect, hang, cut the connection or serve a broken zip are each rejected in one line and the next one
is tried; a good zip becomes a dataset that the paper configuration trains on; the shipped corpus is restored
by the same helper."""

import hashlib
import http.server
import io
import json
import os
import threading
import time
import zipfile

import numpy as np
import pytest

import train
from data import common
from data.shakespeare_char import prepare as char_prepare
from data.wikitext103 import prepare as wikitext_prepare

ARTICLE = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles "
           "( Japanese : 戦場のヴァルキュリア3 , "
           "lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , "
           "is a tactical role @-@ playing video game developed by Sega and Media.Vision for the PlayStation "
           "Portable . \n \n")


def make_zip(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w', zipfile.ZIP_DEFLATED) as z:
        for name, text in members.items():
            z.writestr(f'wikitext-103-raw/{name}', text)
    return buf.getvalue()


GOOD = make_zip({'wiki.train.raw': ARTICLE * 40, 'wiki.valid.raw': ARTICLE * 8, 'wiki.test.raw': ARTICLE * 8})
NO_VALID = make_zip({'wiki.train.raw': ARTICLE * 40, 'wiki.test.raw': ARTICLE})
# one byte of the stored train member flipped: the zip opens, but that member fails its CRC check
_stored = io.BytesIO()
with zipfile.ZipFile(_stored, 'w', zipfile.ZIP_STORED) as _z:
    _z.writestr('wikitext-103-raw/wiki.train.raw', ARTICLE * 40)
    _z.writestr('wikitext-103-raw/wiki.valid.raw', ARTICLE * 8)
BAD_CRC = bytearray(_stored.getvalue())
BAD_CRC[200] ^= 0xFF
BAD_CRC = bytes(BAD_CRC)
CORPUS = open(char_prepare.TEXT, 'rb').read()


class Handler(http.server.BaseHTTPRequestHandler):
    agents = []

    def log_message(self, *args):  # keep the test output clean
        pass

    def send_body(self, body, length=None):
        self.send_response(200)
        self.send_header('Content-Length', str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        Handler.agents.append(self.headers.get('User-Agent', ''))
        if self.path == '/forbidden.zip':
            self.send_error(403)
        elif self.path == '/redirect.zip':
            self.send_response(302)
            self.send_header('Location', '/wikitext.zip')
            self.end_headers()
        elif self.path == '/wikitext.zip':
            self.send_body(GOOD)
        elif self.path == '/truncated.zip':  # a complete transfer of half a zip
            self.send_body(GOOD[:len(GOOD) // 2])
        elif self.path == '/cut.zip':  # the connection closes halfway through the announced length
            self.send_body(GOOD[:len(GOOD) // 2], length=len(GOOD))
        elif self.path == '/no_valid.zip':
            self.send_body(NO_VALID)
        elif self.path == '/bad_crc.zip':
            self.send_body(BAD_CRC)
        elif self.path == '/hang.zip':  # accepts, then says nothing for longer than the client waits
            time.sleep(3)
            self.send_body(GOOD)
        elif self.path == '/input.txt':
            self.send_body(CORPUS)
        elif self.path == '/other.txt':
            self.send_body(b'x' * len(CORPUS))
        else:
            self.send_error(404)


@pytest.fixture(scope='module')
def server():
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    httpd.daemon_threads = True
    httpd.handle_error = lambda request, address: None  # a client that gave up on /hang.zip is expected
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}'
    httpd.shutdown()


@pytest.fixture
def offline(monkeypatch):
    """Only the test's own sources: the built-in ones are on the internet."""
    monkeypatch.setattr(wikitext_prepare, 'SOURCES', [])


def digest(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def test_refused_then_redirected_source_gives_a_dataset_that_trains(server, offline, tmp_path, capsys):
    Handler.agents.clear()
    out = tmp_path / 'wt'
    wikitext_prepare.main([f'--url={server}/forbidden.zip', f'--url={server}/redirect.zip', f'--out_dir={out}'])
    printed = capsys.readouterr().out
    assert 'failed: HTTP 403' in printed and f'using {server}/redirect.zip' in printed
    assert all(a.startswith('Mozilla/5.0') for a in Handler.agents) and len(Handler.agents) == 3  # 403, 302, zip
    assert sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin', wikitext_prepare.ZIP_NAME]
    # counts beside the published ones, with the note (a synthetic zip is not WikiText-103)
    assert 'wiki.valid.raw: 32 lines' in printed and 'published 3,760 lines' in printed and 'note: differs' in printed
    ids = np.fromfile(out / 'val.bin', dtype=np.uint16)
    assert len(ids) > 100 and ids.max() < 200
    # the paper's configuration trains on it, shrunk to seconds on a CPU
    run = tmp_path / 'run'
    train.main(['--config=paper_44m', f'--dataset={out}', '--max_iters=2', '--batch_size=2', '--block_size=32',
                '--n_layer=1', '--n_embd=64', '--n_head=2', '--eval_interval=2', '--eval_iters=1', f'--out_dir={run}'])
    log = [json.loads(line) for line in open(run / 'log.jsonl')]
    assert log[-1]['step'] == 2 and all(np.isfinite(log[-1]['val_loss']))


def test_every_bad_source_is_one_line_and_the_old_dataset_stays(server, offline, tmp_path, capsys):
    out = tmp_path / 'wt'
    wikitext_prepare.main([f'--url={server}/wikitext.zip', f'--out_dir={out}'])
    before = {n: digest(out / n) for n in os.listdir(out)}
    capsys.readouterr()
    bad = ['forbidden', 'truncated', 'cut', 'no_valid', 'bad_crc', 'hang', 'nothing_here']
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        wikitext_prepare.main([f'--url={server}/{b}.zip' for b in bad] + [f'--out_dir={out}', '--timeout=0.5'])
    assert time.time() - t0 < 15  # the hanging source is given up after its timeout, not waited for
    message = str(e.value)
    assert message.count('\n') == 0 and message.startswith('prepare.py: error: no source worked')
    reasons = dict(part.split(' (', 1) for part in message.split('worked: ')[1].split('. With')[0].split('; '))
    for b, why in zip(bad, ['HTTP 403', 'not a readable zip', 'connection closed after', 'lacks wiki.valid.raw',
                            'fails its CRC check', 'timed out', 'HTTP 404']):
        assert why in reasons[f'{server}/{b}.zip'], (b, message)
    assert '--input=PATH' in message
    printed = capsys.readouterr().out
    assert printed.count('trying the next source') == len(bad) - 1
    assert {n: digest(out / n) for n in os.listdir(out)} == before  # the earlier dataset and zip, byte for byte


def test_the_shipped_corpus_is_checked_and_restored_by_the_same_helper(server, tmp_path, monkeypatch):
    copy = tmp_path / 'input.txt'
    monkeypatch.setattr(char_prepare, 'TEXT', str(copy))
    # deleted: downloaded again, from the first source that gives the classic file
    monkeypatch.setattr(char_prepare, 'URLS', [f'{server}/other.txt', f'{server}/input.txt'])
    assert char_prepare.get_text() == CORPUS.decode('utf-8') and digest(copy) == char_prepare.EXPECTED_SHA256
    # edited in place: refused, with the way back
    copy.write_bytes(CORPUS.replace(b'ROMEO', b'ROMEX'))
    with pytest.raises(common.PrepareError, match='not its SHA-256.*git checkout'):
        char_prepare.get_text()
    # deleted with no source that works: one line naming both ways out
    copy.unlink()
    monkeypatch.setattr(char_prepare, 'URLS', [f'{server}/other.txt'])
    with pytest.raises(common.PrepareError,
                       match=r'no source worked.*other.txt \(.*not its SHA-256.*git checkout') as e:
        char_prepare.get_text()
    assert '\n' not in str(e.value) and not os.path.lexists(str(copy) + '.tmp')


def test_the_repository_ships_the_classic_corpus():
    char_prepare.check_classic(char_prepare.TEXT)  # raises if it is missing, edited or damaged


def test_the_shipped_corpus_gives_the_published_counts(tmp_path, capsys):
    char_prepare.main([f'--out_dir={tmp_path}'])
    assert '1,115,394 characters, vocab 65: 1,003,854 train / 111,540 val' in capsys.readouterr().out
    assert len(np.fromfile(tmp_path / 'val.bin', dtype=np.uint16)) == 111_540

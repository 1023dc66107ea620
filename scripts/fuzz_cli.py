#!/usr/bin/env python3
"""Feeds `overlap` mutated inputs and reports every crash: an exit status other than
0, 1 or 2, or a panic. Bad input must be a clear error, never a crash.

    python3 scripts/fuzz_cli.py BIN [--n N] [--seed S] [--only plan,config,profile,checkpoint]

BIN is an `overlap` binary (`cargo build -p overlap-cli`, then target/debug/overlap).
Four targets, each N inputs, one to three mutations apiece:
  plan        `overlap check` on the JSON plan of examples/hsdp_2x2.toml with values
              replaced, removed or duplicated;
  config      `overlap plan` and `overlap verify --steps 1` on the examples' configs
              with values replaced (huge, negative, NaN, wrong types) or keys removed;
  profile     `overlap simulate` and `overlap tune` on hardware/h200-nvlink.toml with
              values replaced;
  checkpoint  `overlap run --resume` from a checkpoint whose manifest, shards or
              `latest` are damaged (shard checksums sometimes updated, so the parser is
              reached).
Each crashing input is kept in the work directory (a temporary one unless --work) and
named on stdout; the exit status is the number of crashes (at most 100).
"""

import argparse
import copy
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hsdp_2x2.toml")
CONFIGS = ["hsdp_2x2", "groups_schedule_2x2", "no_sync_1x4", "pure_fsdp_4x1", "forward_64_layers"]
PROFILE = os.path.join(ROOT, "hardware", "h200-nvlink.toml")
JSON_VALUES = [None, 0, -1, 1, 2, 7, 2**32, 2**63, -(2**63), 2**64, 1e308, 0.5, "", "x",
               "nccl", [], {}, True, [0], {"x": 1}, "../../etc/passwd"]
TOML_VALUES = ["0", "-1", "1", "2", "1e400", "nan", "inf", "-inf", "1e-30", "4294967296",
               "18446744073709551616", '"x"', '""', "[]", "[0]", "[-1]", "true", "{}",
               '"*"', '"muon"', '"bf16"', "9999999", "[1000000,1000000]"]


def run(args, timeout=120):
    """Runs `args`; None when it outlived `timeout` (a hang is reported, not a crash)."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def crashed(r):
    return r is not None and (r.returncode not in (0, 1, 2) or "panicked" in r.stderr)


def json_paths(o, pre=()):
    yield pre
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else []
    for k, v in items:
        yield from json_paths(v, pre + (k,))


def mutate_json(doc, rng):
    paths = list(json_paths(doc))[1:]
    for _ in range(rng.randint(1, 3)):
        p = rng.choice(paths)
        parent = doc
        try:
            for k in p[:-1]:
                parent = parent[k]
            k = p[-1]
            r = rng.random()
            if r < 0.65:
                parent[k] = rng.choice(JSON_VALUES)
            elif r < 0.8:
                del parent[k]
            elif isinstance(parent, list):
                parent.insert(k, copy.deepcopy(parent[k]))
            else:
                parent[str(k) + "_x"] = 1
        except (KeyError, IndexError, TypeError):
            pass
    return doc


def mutate_toml(text, rng):
    lines = text.split("\n")
    keyed = [i for i, l in enumerate(lines) if re.match(r"^\s*[a-z_0-9]+\s*=", l)]
    for _ in range(rng.randint(1, 3)):
        i = rng.choice(keyed)
        key = lines[i].split("=")[0]
        lines[i] = "" if rng.random() < 0.1 else key + "= " + rng.choice(TOML_VALUES)
    return "\n".join(lines)


def fuzz_plan(bin_, work, n, rng, keep):
    text = run([bin_, "plan", "--config", EXAMPLE, "--format", "json"]).stdout
    base = json.loads(text)
    for i in range(n):
        path = os.path.join(work, "plan.json")
        with open(path, "w") as f:
            json.dump(mutate_json(copy.deepcopy(base), rng), f)
        r = run([bin_, "check", "--plan", path])
        if crashed(r):
            keep(path, f"plan-{i}.json", r)


def fuzz_config(bin_, work, n, rng, keep):
    texts = [open(os.path.join(ROOT, "examples", c + ".toml")).read() for c in CONFIGS]
    for i in range(n):
        path = os.path.join(work, "config.toml")
        with open(path, "w") as f:
            f.write(mutate_toml(rng.choice(texts), rng))
        for cmd in (["plan", "--config", path, "--format", "text"],
                    ["verify", "--config", path, "--steps", "1"]):
            r = run(["prlimit", "--as=8000000000", bin_] + cmd)
            if crashed(r):
                keep(path, f"config-{i}.toml", r)
                break


def fuzz_profile(bin_, work, n, rng, keep):
    text = open(PROFILE).read()
    for i in range(n):
        path = os.path.join(work, "profile.toml")
        with open(path, "w") as f:
            f.write(mutate_toml(text, rng))
        for cmd in (["simulate", "--hardware", path, "--config", EXAMPLE],
                    ["tune", "--hardware", path, "--config", EXAMPLE, "--top", "2"]):
            r = run([bin_] + cmd)
            if crashed(r):
                keep(path, f"profile-{i}.toml", r)
                break


def damage_checkpoint(step_dir, rng):
    manifest = os.path.join(step_dir, "manifest.json")
    shards = sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors"))
    r = rng.random()
    if r < 0.5:
        doc = mutate_json(json.load(open(manifest)), rng)
        json.dump(doc, open(manifest, "w"))
        return
    shard = os.path.join(step_dir, rng.choice(shards))
    b = bytearray(open(shard, "rb").read())
    if r < 0.8:
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(min(len(b), 400) if rng.random() < 0.7 else len(b))
            b[j] = rng.randrange(256)
    else:
        b = b[: rng.randrange(len(b))]
    open(shard, "wb").write(b)
    if rng.random() < 0.7:
        # The checksum matches the damaged bytes, so the tensors' parser is reached.
        doc = json.load(open(manifest))
        for entry in doc.get("files", []):
            if isinstance(entry, dict) and shard.endswith(str(entry.get("path", ""))):
                entry["sha256"], entry["bytes"] = hashlib.sha256(b).hexdigest(), len(b)
        json.dump(doc, open(manifest, "w"))


def fuzz_checkpoint(bin_, work, n, rng, keep):
    base = os.path.join(work, "ckpt-base")
    run([bin_, "run", "--config", EXAMPLE, "--steps", "2", "--save-every", "2",
         "--checkpoint", base])
    step = open(os.path.join(base, "latest")).read().strip()
    for i in range(n):
        root = os.path.join(work, "ckpt")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(base, root)
        if rng.random() < 0.15:
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(rng.choice(["step-999999", "../ckpt-base", "", "x" * 5000]))
        else:
            damage_checkpoint(os.path.join(root, step), rng)
        r = run([bin_, "run", "--config", EXAMPLE, "--steps", "1", "--resume", root])
        if crashed(r):
            keep(root, f"checkpoint-{i}", r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bin")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="plan,config,profile,checkpoint")
    ap.add_argument("--work")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="overlap-fuzz-")
    os.makedirs(work, exist_ok=True)
    rng = random.Random(a.seed)
    crashes = []

    def keep(path, name, r):
        dest = os.path.join(work, "crash-" + name)
        (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, dest)
        crashes.append(dest)
        print(f"CRASH {dest}: exit {r.returncode}\n{r.stderr[-600:]}", flush=True)

    targets = {"plan": fuzz_plan, "config": fuzz_config, "profile": fuzz_profile,
               "checkpoint": fuzz_checkpoint}
    for name in a.only.split(","):
        targets[name](os.path.abspath(a.bin), work, a.n, rng, keep)
        print(f"{name}: {a.n} inputs, {len(crashes)} crashes so far", flush=True)
    print(f"work directory: {work}")
    sys.exit(min(len(crashes), 100))


if __name__ == "__main__":
    main()

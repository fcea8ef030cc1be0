"""A harness that steers the evaluator (issue 36, item 3). argv: TARGET [TURNS TOKENS].

After TURNS model calls (none by default), the execution whose id ends in `.0` replaces its
workspace by a symbolic link to TARGET (`{group}` → its group id: `../{group}.1/workspace` is
its sibling's workspace); the others write `right` into answer.txt, which the test's evaluator
rewards with 1. So an evaluator that follows the link scores the sibling's (or a host
directory's) answer for the one that made it."""

import os
import shutil
import sys

target = sys.argv[1]
turns = int(sys.argv[2]) if len(sys.argv) > 2 else 0
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 8
if turns:
    from openai import OpenAI

    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    for _ in range(turns):
        client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"), max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "Say a word."}])
if os.environ["GYRE_EXECUTION_ID"].endswith(".0"):
    os.chdir("..")
    shutil.rmtree("workspace")
    os.symlink(target.format(group=os.environ["GYRE_GROUP_ID"]), "workspace")
else:
    with open("answer.txt", "a") as f:
        f.write("right\n")

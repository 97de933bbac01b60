"""Profile a stories260K ``generate`` run: the per-layer / per-op table of :mod:`tinyattn.profiler`.

The same as ``python -m tinyattn generate --profile TRACE.json`` with the options below, for the docs:
writes ``<out>/<name>.txt`` (generated text + summary table) and ``<out>/<name>.trace.json`` (``<out>``:
``out/bench/`` by default, git-ignored; ``--out docs/bench`` replaces the profile docs/benchmarks.md shows).
The model and tokenizer default to the stories260K shipped with tinyattn.

Layers are attributed by the runtime's ``tinyattn.profiler.layer(i)`` calls; a runtime without them is
given forward pre-hooks on each block's first norm that do the same.

Example::

    python bench/profile_generate.py --page-size 16 --page-budget 4 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common as C  # noqa: E402



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="llama2.c checkpoint (default: the shipped stories260K)")
    p.add_argument("--tokenizer", type=Path, default=None, help="its tokenizer (default: the shipped tok512.bin)")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--page-budget", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT,
                   help="output folder (default: out/bench/, git-ignored; --out docs/bench for the docs' copy)")
    p.add_argument("--name", default="profile_stories260K")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import tinyattn.profiler as tp
    from tinyattn import assets
    from tinyattn.models import LlamaModel, LlamaRuntime, Tokenizer

    model = LlamaModel.from_llama2c(assets.resolve_file(args.model, "--model", assets.default_model_path))
    tok = Tokenizer(assets.resolve_file(args.tokenizer, "--tokenizer", assets.default_tokenizer_path))
    rt = LlamaRuntime(model, page_size=args.page_size, page_budget=args.page_budget, backend="torch")
    source = Path(sys.modules[LlamaModel.__module__].__file__).read_text()
    hooks = []
    if "profiler.layer(" not in source and "spans.layer(" not in source:
        for i, block in enumerate(model.layers):
            def pre(_module, _inputs, i=i):
                from tinyattn.ops import spans
                if spans.recorder is not None:
                    spans.recorder._layer = i
            hooks.append(block.attention_norm.register_forward_pre_hook(pre))
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"{args.name}.trace.json"
    buf = io.StringIO()
    with tp.profile(trace=trace) as prof:
        out = rt.generate([tok.encode(args.prompt, bos=True)], max_new_tokens=args.max_new_tokens,
                          eos_id=None)
    for h in hooks:
        h.remove()
    with redirect_stdout(buf):
        cfg = model.config
        print(f"$ python bench/profile_generate.py --max-new-tokens {args.max_new_tokens} --page-size {args.page_size} "
              f"--page-budget {args.page_budget}")
        print(f"# = python -m tinyattn generate --prompt {args.prompt!r} --max-new-tokens {args.max_new_tokens} "
              f"--page-size {args.page_size} --page-budget {args.page_budget} --backend torch --profile (no EOS stop)")
        print(f"# stories260K: {cfg.n_layers} layers, {cfg.n_heads} query / {cfg.n_kv_heads} KV heads, head_dim "
              f"{cfg.head_dim}; {C.machine_name('cpu')}")
        print(tok.decode(tok.encode(args.prompt, bos=True) + out.tokens[0]))
        print("---")
        print(out.stats.format())
        print("--- profile")
        prof.print_summary()
    text = buf.getvalue()
    print(text)
    (args.out / f"{args.name}.txt").write_text(text)
    print(f"wrote {args.out / (args.name + '.txt')} and {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

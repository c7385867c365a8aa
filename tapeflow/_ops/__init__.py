"""The ops: each op's forward, VJP and check side by side, the generated functions, lift and defop."""

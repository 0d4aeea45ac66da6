#!/bin/bash
# transformer_bench.sh - the character transformer language model of issue 24
# (configs/fortunes_char_transformer.cfg's model without dropout) beside
# PyTorch's (transformer_torch_ref.py): lm_bench.sh --cell transformer, which
# describes the data, the model and what is printed.
#
#   tests/bench/transformer_bench.sh [--steps N] [--build DIR] [--blocks N]
exec "$(dirname "${BASH_SOURCE[0]}")/lm_bench.sh" --cell transformer "$@"

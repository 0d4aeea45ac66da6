# test_seq_torch.py - prints the PyTorch numbers tests/unit/test_seq.c holds (want_*).
# Run once by hand: /usr/bin/python3 tests/unit/test_seq_torch.py (PyTorch 1.13 here); the test never runs Python.
import math, torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
torch.set_default_dtype(torch.float64)
V, D, H, T = 5, 3, 2, 4
ids = [[1, 2, 3, 4], [3, 1, 2, 0]]
lens = [4, 3]
def P(n, k0):  # loom's flat buffer values, from offset k0
    return torch.tensor([0.5 * math.sin(0.37 * (k0 + i) + 0.1) for i in range(n)])
table = P(V * D, 0).reshape(V, D)
x = torch.stack([table[torch.tensor(r)] for r in ids])
def run(kind, bidir, merge, seq):
    g = 4 if kind == 'lstm' else 3
    mod = (torch.nn.LSTM if kind == 'lstm' else torch.nn.GRU)(D, H, batch_first=True, bidirectional=bidir)
    k = V * D
    with torch.no_grad():
        for sfx in (['', '_reverse'] if bidir else ['']):
            W = P(D * g * H, k).reshape(D, g * H); k += D * g * H
            U = P(H * g * H, k).reshape(H, g * H); k += H * g * H
            getattr(mod, 'weight_ih_l0' + sfx).copy_(W.T)
            getattr(mod, 'weight_hh_l0' + sfx).copy_(U.T)
            if kind == 'lstm':
                b = P(g * H, k); k += g * H
                getattr(mod, 'bias_ih_l0' + sfx).copy_(b)
                getattr(mod, 'bias_hh_l0' + sfx).zero_()
            else:
                b = P(2 * g * H, k).reshape(2, g * H); k += 2 * g * H
                getattr(mod, 'bias_ih_l0' + sfx).copy_(b[0])
                getattr(mod, 'bias_hh_l0' + sfx).copy_(b[1])
    out, hn = mod(pack_padded_sequence(x, torch.tensor(lens), batch_first=True, enforce_sorted=False))
    if kind == 'lstm': hn = hn[0]
    out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
    if seq:
        y = out
        if bidir and merge == 'sum': y = out[..., :H] + out[..., H:]
    else:
        if bidir: y = hn[0] + hn[1] if merge == 'sum' else torch.cat([hn[0], hn[1]], -1)
        else: y = hn[0]
    return y.reshape(-1).tolist()
for name, args in [('lstm_seq', ('lstm', False, '', True)), ('gru_seq', ('gru', False, '', True)),
                   ('gru_last', ('gru', False, '', False)), ('bi_lstm_concat_seq', ('lstm', True, 'concat', True)),
                   ('bi_gru_sum_last', ('gru', True, 'sum', False)), ('lstm_last', ('lstm', False, '', False))]:
    v = run(*args)
    print('static const double want_%s[%d] = {%s};' % (name, len(v), ', '.join('%.9g' % a for a in v)))

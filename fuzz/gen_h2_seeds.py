#!/usr/bin/env python3
"""Writes the h2_splice fuzz seeds for the splice's limits (fuzz/seeds/h2_splice):
frames by hand, so each seed is one case a reader can name."""
import struct, os
def fr(kind, flags, stream, payload=b''):
    return struct.pack('>I', len(payload))[1:] + bytes([kind, flags]) + struct.pack('>I', stream) + payload
def settings(*kv):
    return fr(4, 0, 0, b''.join(struct.pack('>HI', k, v) for k, v in kv))
ACK = fr(4, 1, 0)
def lit(n, v):  # literal without indexing, new name
    return bytes([0, len(n)]) + n + bytes([len(v)]) + v
def lit_idx(n, v):  # literal with incremental indexing, new name
    return bytes([0x40, len(n)]) + n + bytes([len(v)]) + v
def upd(n):  # table size update, 5-bit prefix
    if n < 31: return bytes([0x20 | n])
    out = [0x3f]; n -= 31
    while n >= 128: out.append((n % 128) | 0x80); n //= 128
    out.append(n); return bytes(out)
CREATE = b'/containerd.services.images.v1.Images/Create'
req = b'\x83' + lit(b':path', CREATE) + lit(b'containerd-namespace', b'buildkit')
def seed(name, client, server):
    open(os.path.join(os.path.dirname(__file__), 'seeds', 'h2_splice', name), 'wb').write(struct.pack('>H', len(client)) + client + server)
# CONTINUATION counts: a flood of empty ones, and a block in many small ones.
c = settings() + fr(1, 0, 1, req) + b''.join(fr(9, 0, 1) for _ in range(1100))
seed('continuation_flood', c, settings() + ACK)
parts = [req[i:i+4] for i in range(0, len(req), 4)]
c = settings() + fr(1, 0, 1, parts[0]) + b''.join(fr(9, 0, 1, p) for p in parts[1:]) + fr(9, 0, 1) + fr(9, 4, 1) + fr(0, 1, 1, b'\0\0\0\0\0')
s = settings() + ACK + fr(1, 4, 1, b'\x88') + fr(0, 0, 1, b'\0\0\0\0\0') + fr(1, 5, 1, lit(b'grpc-status', b'0'))
seed('continuation_split', c, s)
# Table size updates against SETTINGS_HEADER_TABLE_SIZE, before and after ACKs.
c = settings((1, 8192)) + ACK + fr(1, 4, 1, upd(8192) + req) + fr(0, 1, 1, b'\0\0\0\0\0') + settings((1, 0)) + fr(1, 4, 3, upd(16384) + req)
s = settings((1, 16384)) + ACK + fr(1, 4, 1, upd(8192) + b'\x88' + lit_idx(b'x-a', b'b')) + fr(0, 0, 1, b'\0\0\0\0\0') + fr(1, 5, 1, upd(0) + lit(b'grpc-status', b'0'))
seed('table_size_settings', c, s)
# A held reply bigger than the client's stream window, granted more later.
msg = b'\x0a\xb5\x17' + bytes(i % 256 for i in range(2997))
data = b'\0' + struct.pack('>I', len(msg)) + msg
c = settings((4, 1000)) + fr(1, 4, 1, req) + fr(0, 1, 1, b'\0\0\0\0\0') + fr(8, 0, 1, struct.pack('>I', len(data) - 1000))
s = settings() + ACK + fr(1, 4, 1, b'\x88') + fr(0, 0, 1, data[:1000]) + fr(0, 0, 1, data[1000:]) + fr(1, 5, 1, lit(b'grpc-status', b'0'))
seed('held_window', c, s)
# A request block the mirror cannot decode (dynamic index it never saw).
seed('hpack_desync', settings() + fr(1, 5, 1, b'\x83\xbe'), settings() + ACK)

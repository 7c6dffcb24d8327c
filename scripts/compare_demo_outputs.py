#!/usr/bin/env python3
"""Usage: compare_demo_outputs.py BEFORE_DIR AFTER_DIR

Compares two `loraq demo` output trees: every file byte for byte after replacing the
output path, with wall-time fields ("seconds") zeroed in JSON reports and the SHA256SUMS
lines of those files ignored."""
import hashlib, json, os, re, sys
before, after = sys.argv[1], sys.argv[2]
TOL = False
def files(root):
    out = set()
    for d, _, fs in os.walk(root):
        for f in fs:
            out.add(os.path.relpath(os.path.join(d, f), root))
    return out
def norm(root, rel):
    data = open(os.path.join(root, rel), 'rb').read()
    data = data.replace(root.encode(), b'<OUT>')
    if rel.endswith('.json'):
        try:
            v = json.loads(data)
        except Exception:
            return data
        def z(x):
            if isinstance(x, float) and TOL:
                return float(f'{x:.12g}')
            if isinstance(x, dict):
                return {k: (0 if k in ('seconds',) else z(w)) for k, w in x.items()}
            if isinstance(x, list):
                return [z(w) for w in x]
            return x
        return json.dumps(z(v), sort_keys=True).encode()
    if rel.endswith('README.md'):
        # the model card prints the wall time
        data = re.sub(rb'[0-9.]+ s\b', b'<T> s', data)
    if rel.endswith('SHA256SUMS'):
        # hashes of the files that name the output path or the wall time
        data = b''.join(l for l in data.splitlines(True) if not re.search(rb'(extraction_report\.json|README\.md|adapter_config\.json|manifest\.json)$', l.strip()))
    return data
fb, fa = files(before), files(after)
print('only before:', sorted(fb - fa)); print('only after:', sorted(fa - fb))
same_raw = same_norm = 0; differ = []
for rel in sorted(fb & fa):
    a = open(os.path.join(before, rel), 'rb').read(); b = open(os.path.join(after, rel), 'rb').read()
    if a == b:
        same_raw += 1
    elif norm(before, rel) == norm(after, rel):
        same_norm += 1
    else:
        differ.append(rel)
TOL = True
close = [rel for rel in differ if norm(before, rel) == norm(after, rel)]
differ = [rel for rel in differ if rel not in close]
print('equal to 12 significant digits (last-bit float differences):', close)
print(f'{len(fb & fa)} files: {same_raw} byte-identical, {same_norm} identical after path/wall-time normalization, {len(differ)} differ: {differ}')

#!/usr/bin/env python3
"""retype.py: a copy of a GGUF file whose tensors matching a name pattern hold random blocks of
another type (for the model suite's bad input: experts of a type tandem has no kernels for,
such as Q5_K). Metadata and every other tensor are copied as they are.

usage: retype.py IN OUT PATTERN TYPE      (PATTERN: a substring of the names; TYPE: Q5_K, ...)
"""
import sys

import numpy as np


def main(argv):
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    import gguf
    src, dst, pattern, tname = argv
    qt = gguf.GGMLQuantizationType[tname]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    r = gguf.GGUFReader(src)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [str(bytes(field.parts[i]), "utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, val, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(key, str(bytes(field.parts[-1]), "utf-8"), vt)
        else:
            w.add_key_value(key, field.parts[-1].tolist()[0], vt)
    rng = np.random.default_rng(1)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order
        if pattern in t.name:
            rows = int(np.prod(shape[:-1]))
            data = rng.integers(0, 256, size=(rows, shape[-1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(t.name, data.reshape(*shape[:-1], -1), raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

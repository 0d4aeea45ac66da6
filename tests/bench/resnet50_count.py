#!/usr/bin/python3
"""resnet50_count.py - the layer and parameter counts of Keras' ResNet-50
(tf.keras.applications.ResNet50, weights=None, include_top=True, 1000
classes, 224x224x3), computed from the architecture table below, for
comparing with `loom check configs/resnet50.cfg`. It reads nothing from Loom.

  tests/bench/resnet50_count.py                 # the expected counts, one JSON line
  tests/bench/resnet50_count.py --cfg FILE      # the same counts recomputed from FILE's
                                                # layer list (shape inference on the config
                                                # text); exit 1 if its parameters differ
  tests/bench/resnet50_count.py --emit-cfg      # the model.layers list of configs/resnet50.cfg
  tests/bench/resnet50_count.py --keras         # also build the model with tf.keras (if
                                                # importable) and compare its counts

Keras' own figures (model.summary()): 25,636,712 total, 25,583,592 trainable,
53,120 non-trainable (batch normalization's moving mean and variance), 177
layers including the InputLayer (176 without it).
"""
import json
import re
import sys

KERAS_TOTAL = 25_636_712
KERAS_TRAINABLE = 25_583_592
KERAS_NON_TRAINABLE = 53_120
KERAS_LAYERS = 177  # model.layers, with the InputLayer

# (stage name, filters, blocks, first block's stride): keras.applications.resnet.ResNet50's stack_fn
STAGES = [("conv2", 64, 3, 1), ("conv3", 128, 4, 2), ("conv4", 256, 6, 2), ("conv5", 512, 3, 2)]
EPS = "1.001e-5"  # Keras' ResNet BatchNormalization epsilon


def layers():
    """The Keras layer list as dicts: the Loom config's keys (name, type, inputs, ...)."""
    L = []

    def add(**kw):
        L.append(kw)
        return kw["name"]

    add(type="zero_padding2d", name="conv1_pad", padding=3)
    add(type="conv2d", name="conv1_conv", filters=64, kernel_size=7, strides=2)
    add(type="batch_normalization", name="conv1_bn")
    add(type="activation", name="conv1_relu", activation="relu")
    add(type="zero_padding2d", name="pool1_pad", padding=1)
    x = add(type="max_pool2d", name="pool1_pool", pool_size=3, strides=2)
    for stage, f, blocks, stride in STAGES:
        for b in range(1, blocks + 1):
            p = f"{stage}_block{b}"
            st = {"strides": stride} if b == 1 and stride != 1 else {}
            if b == 1:  # conv_shortcut=True: a 1x1 projection
                add(type="conv2d", name=p + "_0_conv", inputs=[x], filters=4 * f, kernel_size=1, **st)
                short = add(type="batch_normalization", name=p + "_0_bn")
            else:
                short = x
            add(type="conv2d", name=p + "_1_conv", inputs=[x], filters=f, kernel_size=1, **st)
            add(type="batch_normalization", name=p + "_1_bn")
            add(type="activation", name=p + "_1_relu", activation="relu")
            add(type="conv2d", name=p + "_2_conv", filters=f, kernel_size=3, padding="same")
            add(type="batch_normalization", name=p + "_2_bn")
            add(type="activation", name=p + "_2_relu", activation="relu")
            add(type="conv2d", name=p + "_3_conv", filters=4 * f, kernel_size=1)
            last = add(type="batch_normalization", name=p + "_3_bn")
            add(type="add", name=p + "_add", inputs=[short, last])  # Keras: Add()([shortcut, x])
            x = add(type="activation", name=p + "_out", activation="relu")
    add(type="global_average_pooling2d", name="avg_pool")
    add(type="dense", name="predictions", units=1000, activation="softmax")
    return L


def count(L, input_shape=(224, 224, 3)):
    """Shape inference and parameter counts over a layer list (dicts with the
    config's keys; `inputs` defaults to the previous layer). Conv and dense
    have a bias unless use_bias is false (Keras' default: true)."""
    shapes = {"image": tuple(input_shape)}
    prev = "image"
    total = trainable = 0
    flops = 0  # forward multiply-adds x 2, per image
    for l in L:
        ins = l.get("inputs") or [prev]
        for i in ins:
            if i not in shapes:
                raise ValueError(f"layer {l['name']}: unknown input {i}")
        s = shapes[ins[0]]
        t = l["type"]
        if t == "zero_padding2d":
            p = int(l["padding"])
            out = (s[0] + 2 * p, s[1] + 2 * p, s[2])
        elif t in ("conv2d", "max_pool2d"):
            k = int(l.get("kernel_size", l.get("pool_size", 2)))
            st = int(l.get("strides", 1 if t == "conv2d" else k))
            c = int(l["filters"]) if t == "conv2d" else s[2]
            if l.get("padding", "valid") == "same":
                h, w = -(-s[0] // st), -(-s[1] // st)
            else:
                h, w = (s[0] - k) // st + 1, (s[1] - k) // st + 1
            out = (h, w, c)
            if t == "conv2d":
                n = k * k * s[2] * c + (c if l.get("use_bias", True) else 0)
                total += n
                trainable += n
                flops += 2 * h * w * k * k * s[2] * c
        elif t == "batch_normalization":
            out = s
            total += 4 * s[-1]
            trainable += 2 * s[-1]
        elif t == "activation":
            out = s
        elif t == "add":
            for i in ins[1:]:
                if shapes[i] != s:
                    raise ValueError(f"layer {l['name']}: add of {s} and {shapes[i]}")
            out = s
        elif t == "global_average_pooling2d":
            out = (s[2],)
        elif t == "dense":
            u = int(l["units"])
            n = s[0] * u + (u if l.get("use_bias", True) else 0)
            total += n
            trainable += n
            flops += 2 * s[0] * u
            out = (u,)
        else:
            raise ValueError(f"layer {l['name']}: unknown type {t}")
        if l["name"] in shapes:
            raise ValueError(f"duplicate layer name {l['name']}")
        shapes[l["name"]] = out
        prev = l["name"]
    return {"layers": len(L), "layers_with_input": len(L) + 1, "total": total, "trainable": trainable,
            "non_trainable": total - trainable, "output_shape": list(shapes[prev]),
            "forward_gflops_per_image": round(flops / 1e9, 4)}


def parse_cfg(path):
    """The layer dicts of a Loom config's model.layers, one `{ type = ...; }`
    group per layer (the form configs/resnet50.cfg is written in)."""
    text = open(path).read()
    text = re.sub(r"#[^\n]*", "", text)
    m = re.search(r"\blayers\s*=\s*\(", text)
    if not m:
        raise ValueError(f"{path}: no model.layers list")
    body_end = text.find(")", m.end())  # the list's end: layers hold [...] and {...}, never (...)
    L = []
    for g in re.finditer(r"\{([^{}]*)\}", text[m.end():body_end]):
        body = g.group(1)
        if "type" not in body:
            continue
        d = {}
        for k, v in re.findall(r"(\w+)\s*=\s*([^;]+);", body):
            v = v.strip()
            if v.startswith("["):
                d[k] = re.findall(r'"([^"]*)"', v) if '"' in v else [int(x) for x in re.findall(r"-?\d+", v)]
            elif v.startswith('"'):
                d[k] = v.strip('"')
            elif v in ("true", "false"):
                d[k] = v == "true"
            else:
                d[k] = v
        if "type" in d:
            L.append(d)
    if not L:
        raise ValueError(f"{path}: no layers found")
    for i, l in enumerate(L):
        l.setdefault("name", f"layer_{i}")
    return L


def emit_cfg(L):
    lines = []
    for l in L:
        if l["name"].endswith("_block1_0_conv") or (l["name"].endswith("_1_conv") and "_block" in l["name"]
                                                    and not l["name"].endswith("block1_1_conv")):
            blk = l["name"].rsplit("_", 2)[0]
            lines.append(f"    # {blk}" + (" (a 1x1 conv projection shortcut)" if l["name"].endswith("_0_conv") else ""))
        parts = [f'type = "{l["type"]}"', f'name = "{l["name"]}"']
        if "inputs" in l:
            parts.append("inputs = [" + ", ".join(f'"{i}"' for i in l["inputs"]) + "]")
        for k in ("filters", "units", "kernel_size", "pool_size", "strides", "padding", "activation"):
            if k in l:
                v = l[k]
                parts.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}")
        if l["type"] == "batch_normalization":
            parts.append(f"epsilon = {EPS}")
        lines.append("    { " + "; ".join(parts) + "; },")
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join(lines)


def keras_counts():
    import tensorflow as tf  # noqa: only with --keras
    m = tf.keras.applications.ResNet50(weights=None, include_top=True, classes=1000, input_shape=(224, 224, 3))
    tr = int(sum(tf.keras.backend.count_params(w) for w in m.trainable_weights))
    nt = int(sum(tf.keras.backend.count_params(w) for w in m.non_trainable_weights))
    return {"tensorflow": tf.__version__, "layers_with_input": len(m.layers), "total": tr + nt,
            "trainable": tr, "non_trainable": nt}


def main():
    args = sys.argv[1:]
    L = layers()
    if "--emit-cfg" in args:
        print(emit_cfg(L))
        return 0
    res = count(L)
    res["keras_reported"] = {"total": KERAS_TOTAL, "trainable": KERAS_TRAINABLE,
                             "non_trainable": KERAS_NON_TRAINABLE, "layers_with_input": KERAS_LAYERS}
    ok = (res["total"], res["trainable"], res["layers_with_input"]) == (KERAS_TOTAL, KERAS_TRAINABLE, KERAS_LAYERS)
    if "--cfg" in args:
        path = args[args.index("--cfg") + 1]
        c = count(parse_cfg(path))
        res["cfg"] = {"path": path, **c}
        # Parameters must match; the layer count is reported (a config that pads
        # with padding = "same" instead of zero_padding2d has 2 layers fewer).
        res["cfg"]["layers_match"] = c["layers"] == res["layers"]
        if (c["total"], c["trainable"]) != (res["total"], res["trainable"]):
            ok = False
    if "--keras" in args:
        try:
            k = keras_counts()
        except ImportError as e:
            k = {"error": f"tensorflow not importable: {e}"}
        res["keras"] = k
        if "total" in k and (k["total"], k["trainable"]) != (res["total"], res["trainable"]):
            ok = False
    res["ok"] = ok
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

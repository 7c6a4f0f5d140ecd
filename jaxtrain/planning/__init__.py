"""Planning: what a run will need and how it should be laid out, decided before (or
without) running it.

    resolve.py    every `auto` setting resolved once for where the program runs
    footprint.py  memory per device: a lower bound (the door check) and an estimate
    flops.py      FLOPs per token, device peaks (MFU)
    compile.py    `jaxtrain compile`: the real train step compiled for a TPU slice or GPU cluster
    decode.py     `jaxtrain compile --mode decode`: generation compiled likewise
    report.py     the compile reports: collectives, suggestions, text
    planner.py    `jaxtrain plan`: search mesh x remat x microbatches, prune, confirm by compile
"""

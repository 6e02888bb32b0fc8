"""Benchmarks: tools that time the library, one module per tool (``python -m <module>``).

    steps        each scheme's model train and inference steps against a baseline's
    routes       each attention kernel and route at one shape; points for the route table
    compile      compile seconds with unrolled and with scanned layers
    pipeline     the masked-LM input pipeline alone, per simulated host
    model_steps  the masked-LM BERT (causal LM: causal-only schemes) that the tools time, as
                 train.py steps it or with logits at every token
    timing       medians of steps timed alternately
    flags        the model-shape flags several tools take, and the check of the files they write
"""

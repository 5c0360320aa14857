"""Training: the optimizer state, the compiled step (`make_step`), the loop
(`fit`, its run and compiled dispatch), and the components `fit` takes:
sampling, streams, evaluation, progress, coupled losses."""

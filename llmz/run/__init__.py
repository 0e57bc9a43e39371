"""The run's housekeeping: what a training run needs around the model, and nothing the model needs.

    launch.py       who am I among the ranks (mpiexec), how they agree at start and end together on a failure
    watchdog.py     every collective has a deadline; the line that names the rank that did not arrive
    environment.py  which Python and which mpiexec started us; a process of this host, from /proc
    threads.py      one BLAS thread pool per rank, sized to the cores the ranks of a host share
    files.py        opening the files a user names, safely; llm.c's headers; writing a file whole or not at all
    lock.py         which live run writes a checkpoint folder or a --log file
    model_file.py   llm.c model files (fp32, bf16): what --save writes and --init-from, llmz.sample read
    state.py        the training state beyond the model file (m, v, the step, the data, the RNG) and the
                    checkpoint folders that hold it
    checkpoints.py  a run's checkpoints: where it starts (--resume, --init-from), what it saves, what it forgets
    guards.py       what stops a run: a GPU it cannot fit, divergence, non-finite values
    log.py          what a run says: its lines on stdout and its --log records
    progress.py     elapsed time and ETA

The model's side (llmz.config, llmz.model, llmz.zero, llmz.comm, ...) imports none of these; llmz.trainer
puts the two together, and the commands (python -m llmz.train, ...) start them.
"""

"""The run's housekeeping: what a training run needs around the model, and nothing the model needs.

    loop.py         the training run: Run (a llmz.trainer.Trainer with everything below) and train(), the loop
    launch.py       who am I among the ranks (mpiexec), how they agree at start and end together on a failure
    watchdog.py     every collective has a deadline; the line that names the rank that did not arrive
    environment.py  which Python and which mpiexec started us; a process of this host, from /proc
    threads.py      one BLAS thread pool per rank, sized to the cores the ranks of a host share, one left free
    outputs.py      the outputs a command line names, checked at start; the --log file; who holds a lock
    lock.py         which live run writes a checkpoint folder or a --log file
    model_file.py   llm.c model files (fp32, bf16): what --save writes and --init-from, llmz.sample read
    state.py        the training state beyond the model file (m, v, the step, the data, the RNG) and the
                    checkpoint folders that hold it
    checkpoints.py  a run's checkpoints: where it starts (--resume, --init-from), what it saves, what it forgets
    guards.py       what stops a run: divergence, non-finite values (a GPU it cannot fit: llmz.memory)
    log.py          what a run says: its lines on stdout and its --log records
    folder.py       the run folder it writes into unless told otherwise: runs/NNN/ (model, log, checkpoints)
    progress.py     elapsed time and ETA

The model's side (llmz.config, llmz.model, llmz.zero, llmz.comm, llmz.trainer, llmz.data, llmz.files, ...)
imports none of these: loop.py's Run puts the two together, and the commands (python -m llmz.train, ...)
start them.
"""

"""How processes, devices and platforms are started, guarded and rehearsed.

`launch` starts torchrun (or accelerate) and stops it in order; `rank_guard` ties every rank's life to
torchrun's and torchrun's to the launcher's; `rank_pool` keeps a notebook's ranks warm between runs;
`device` picks the device and records CUDA calls in a rehearsal (`rehearsal`: a GPU profile's notebook on
a machine without GPUs); `envinfo` says what this machine is; `cudadriver` picks torch's wheel index from
the driver (stdlib only: the Makefile and a Colab first cell run it as a file); `hosted` is Colab/Kaggle;
`quiet` filters third-party import noise; `hooks` is the one seam where the test suite changes how
processes start (nothing sets it for a student or an instructor).
"""

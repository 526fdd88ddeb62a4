"""Cluster layouts for the shell launchers in launch/: which process runs where, with which
environment and command line, on a TPU pod (gcloud TPU VMs or a GKE JobSet) and a SLURM GPU
cluster; plus the readiness and storage checks the launched processes run. Standard library only
(it runs before any install step)."""

"""Launch plans: which process runs where, with which environment and command line, for a TPU
pod (gcloud TPU VMs or a GKE JobSet) and a SLURM GPU cluster; plus the readiness and storage
checks the launchers run. Standard library only (it runs before any install step)."""

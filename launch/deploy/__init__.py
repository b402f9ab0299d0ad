"""Where processes run: the chip planner (`chips`), local server processes (`local`), TPU VMs
through gcloud (`tpu_vm`) and GKE JobSets (`gke`, `gke_pod`)."""

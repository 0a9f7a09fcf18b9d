//! [`RealHost`]: the raw attribution facts of the machine the agent runs on.

use std::fs;
use std::io;
use std::path::PathBuf;

use apron_common::GpuIdentity;

use super::{AttributionConfig, HostView, PodDevices, users};

/// Reads procfs, `passwd` and the Slurm per-GPU files under the configured paths, and asks
/// the kubelet's pod-resources socket (with the `kubernetes` feature).
pub struct RealHost {
    config: AttributionConfig,
    /// Made on the first `List()` call, so that nodes without a kubelet never start one.
    /// Current-thread: the call is one request on a sampler thread, which blocks on it.
    #[cfg(feature = "kubernetes")]
    runtime: std::sync::Mutex<Option<tokio::runtime::Runtime>>,
    /// Pod labels from the API server, where the agent lists them.
    #[cfg(feature = "kubernetes")]
    labels: Option<std::sync::Arc<super::kube::PodLabels>>,
}

impl RealHost {
    pub fn new(config: &AttributionConfig) -> Self {
        Self {
            config: config.clone(),
            #[cfg(feature = "kubernetes")]
            runtime: std::sync::Mutex::new(None),
            #[cfg(feature = "kubernetes")]
            labels: None,
        }
    }

    /// Answers [`HostView::pod_labels`] from the API server's labels.
    #[cfg(feature = "kubernetes")]
    pub fn with_pod_labels(mut self, labels: std::sync::Arc<super::kube::PodLabels>) -> Self {
        self.labels = Some(labels);
        self
    }

    fn proc_file(&self, pid: u32, name: &str) -> io::Result<String> {
        fs::read_to_string(self.config.proc_root.join(pid.to_string()).join(name))
    }

    /// Where a GPU's Slurm file may be, most specific first: our prolog's file for the GPU
    /// (or, for a MIG instance, for its parent: the job then holds the whole GPU), then
    /// jobstats' (`<MIG-UUID>` for an instance, `<index>` for a GPU or a MIG parent).
    fn slurm_paths(&self, gpu: &GpuIdentity) -> Vec<PathBuf> {
        let (ours, jobstats) = (&self.config.apron_slurm_dir, &self.config.slurm_gpu_dir);
        let uuid = gpu.gpu_uuid.as_str();
        let parent = gpu.parent_gpu_uuid.as_ref().map(|p| p.as_str());
        let index = gpu.gpu_index.to_string();
        let candidates = [
            Some((ours, uuid)),
            parent.map(|p| (ours, p)),
            gpu.is_mig().then_some((jobstats, uuid)),
            Some((jobstats, index.as_str())),
        ];
        candidates
            .into_iter()
            .flatten()
            // A UUID comes from the driver, but it becomes a path here: never let it climb.
            .filter(|(_, name)| !name.contains('/') && *name != "." && *name != "..")
            .map(|(dir, name)| dir.join(name))
            .collect()
    }

    #[cfg(feature = "kubernetes")]
    fn list_pods(&self) -> io::Result<Vec<PodDevices>> {
        if tokio::runtime::Handle::try_current().is_ok() {
            // block_on would panic there; the agent calls from a plain sampler thread.
            return Err(io::Error::other("pod-resources must not be called inside a tokio runtime"));
        }
        let mut runtime = self.runtime.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if runtime.is_none() {
            *runtime = Some(tokio::runtime::Builder::new_current_thread().enable_all().build()?);
        }
        let runtime = runtime.as_ref().ok_or_else(|| io::Error::other("no runtime"))?;
        let socket = &self.config.pod_resources_socket;
        // A call's connection task outlives it and closes at the next call, when the
        // runtime runs again: one idle unix connection to the kubelet, no more.
        runtime.block_on(super::podresources::list(socket, self.config.pod_resources_timeout)).map_err(io::Error::other)
    }

    #[cfg(not(feature = "kubernetes"))]
    fn list_pods(&self) -> io::Result<Vec<PodDevices>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{} exists, but this agent was built without the `kubernetes` feature",
                self.config.pod_resources_socket.display()
            ),
        ))
    }
}

impl HostView for RealHost {
    #[cfg(feature = "kubernetes")]
    fn pod_labels(&self, namespace: &str, pod: &str) -> Option<String> {
        self.labels.as_ref().and_then(|l| l.get(namespace, pod))
    }

    fn cgroup(&self, pid: u32) -> io::Result<String> {
        self.proc_file(pid, "cgroup")
    }

    fn status(&self, pid: u32) -> io::Result<String> {
        self.proc_file(pid, "status")
    }

    fn user_name(&self, uid: u32) -> Option<String> {
        // Read per call: the attributor asks once per new process, and a cached copy would
        // miss users added since.
        let passwd = fs::read_to_string(&self.config.passwd_path).ok()?;
        users::passwd_name(&passwd, uid)
    }

    fn slurm_gpu_file(&self, gpu: &GpuIdentity) -> io::Result<Option<String>> {
        for path in self.slurm_paths(gpu) {
            match fs::read_to_string(&path) {
                Ok(text) => return Ok(Some(text)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
            }
        }
        Ok(None)
    }

    fn pod_resources(&self) -> io::Result<Option<Vec<PodDevices>>> {
        // No socket: not a Kubernetes node (or the kubelet's directory is not mounted).
        if !self.config.pod_resources_socket.try_exists()? {
            return Ok(None);
        }
        self.list_pods().map(Some)
    }
}

#[cfg(feature = "kubernetes")]
impl Drop for RealHost {
    fn drop(&mut self) {
        // Dropping a runtime blocks until its tasks stop, which panics if the host is
        // dropped inside async code (e.g. at agent shutdown); nothing of ours is running.
        let runtime = self.runtime.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(runtime) = runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::attribution::Attributor;
    use crate::attribution::test_support::gpu;

    const GPU0: &str = "GPU-5fd4c3a1-7b2e-4c1d-9a8f-0e6d5c4b3a21";
    const GPU1: &str = "GPU-0b8e2d47-3c19-4f6a-8e25-7d9c1a0f6b34";
    const GPU2: &str = "GPU-9c2f6e18-5a4b-4d3c-b1e0-2f7a8d6c5e43";
    const MIG0: &str = "MIG-2c6b1f0e-8d3a-5e4f-9b7c-1a0d2e3f4b5c";
    const POD_CID: &str = "4f5c2a9e0b1d8c7a6f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0f9e";

    /// `agent/tests/fixtures/attribution`: a procfs with a pod process (pid 1001), a Slurm
    /// process (2002), a login-shell process (3003) and one whose status is missing (4004).
    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/attribution")
    }

    fn config(root: &Path) -> AttributionConfig {
        AttributionConfig {
            proc_root: root.join("proc"),
            passwd_path: root.join("etc/passwd"),
            slurm_gpu_dir: root.join("run/gpustat"),
            apron_slurm_dir: root.join("run/apron/slurm"),
            pod_resources_socket: root.join("no-kubelet.sock"),
            ..AttributionConfig::default()
        }
    }

    #[test]
    fn reads_the_fixture_tree() {
        let host = RealHost::new(&config(&fixtures()));
        assert!(host.cgroup(1001).expect("cgroup").contains(POD_CID));
        assert!(host.status(2002).expect("status").contains("Uid:\t1002"));
        assert_eq!(host.cgroup(9999).map_err(|e| e.kind()).err(), Some(io::ErrorKind::NotFound));
        assert_eq!(host.user_name(1002).as_deref(), Some("bob"));
        assert_eq!(host.user_name(4242), None);
        assert_eq!(host.pod_resources().expect("no socket is no kubelet"), None);

        // Ours by UUID; jobstats by index; jobstats by MIG UUID; nothing.
        let file = |g| host.slurm_gpu_file(&g).expect("readable");
        assert!(file(gpu(GPU1, 1, None)).is_some_and(|t| t.contains("job_id=5150")));
        assert_eq!(file(gpu(GPU2, 2, None)).as_deref(), Some("6001 1002\n"));
        assert_eq!(file(gpu(MIG0, 3, Some(GPU2))).as_deref(), Some("7007 1001\n"));
        assert_eq!(file(gpu(GPU0, 0, None)), None);
    }

    #[test]
    fn attributes_slurm_and_host_processes_through_real_host() {
        let config = config(&fixtures());
        let attributor = Attributor::new(&config, Box::new(RealHost::new(&config)));
        assert_eq!(attributor.refresh(), Vec::<String>::new());

        // Slurm job 5150 holds GPU 1 (our prolog's file).
        let gpu1 = gpu(GPU1, 1, None);
        let owner = attributor.gpu_owner(&gpu1).expect("held by a job");
        assert_eq!(owner.job_id.as_deref(), Some("5150"));
        assert_eq!(owner.user.as_deref(), Some("bob"));
        assert_eq!(owner.account.as_deref(), Some("physics"));
        assert_eq!(owner.pod, None);

        // Its process: job from the cgroup, user from status + passwd.
        let slurm = attributor.process(&gpu1, 2002);
        assert_eq!(slurm.job_id.as_deref(), Some("5150"));
        assert_eq!(slurm.user.as_deref(), Some("bob"));
        assert_eq!(slurm.container_id, None);

        // A login-shell process on GPU 2 (held by jobstats job 6001): job from the file.
        let shell = attributor.process(&gpu(GPU2, 2, None), 3003);
        assert_eq!(shell.job_id.as_deref(), Some("6001"));
        assert_eq!(shell.user.as_deref(), Some("alice"));

        // jobstats knows only the uid; the name comes from passwd.
        let owner2 = attributor.gpu_owner(&gpu(GPU2, 2, None)).expect("held by a job");
        assert_eq!((owner2.job_id.as_deref(), owner2.user.as_deref()), (Some("6001"), Some("bob")));

        // No status: the user comes from the GPU's Slurm file.
        let no_status = attributor.process(&gpu1, 4004);
        assert_eq!(no_status.user.as_deref(), Some("bob"));

        assert_eq!(attributor.gpu_owner(&gpu(GPU0, 0, None)), None);
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn resolves_pods_from_a_real_kubelet_socket() {
        use crate::attribution::podresources::fake_kubelet::{FakeKubelet, pods};

        let mut kubelet = FakeKubelet::start(pods(&[
            ("ml", "train-0", vec![("trainer", "nvidia.com/gpu", vec![GPU0])]),
            ("nb", "jupyter-7", vec![("notebook", "nvidia.com/mig-1g.10gb", vec![MIG0])]),
        ]));
        let config = AttributionConfig { pod_resources_socket: kubelet.socket().to_owned(), ..config(&fixtures()) };
        let attributor = Attributor::new(&config, Box::new(RealHost::new(&config)));
        assert_eq!(attributor.refresh(), Vec::<String>::new());

        let gpu0 = gpu(GPU0, 0, None);
        let owner = attributor.gpu_owner(&gpu0).expect("held by a pod");
        assert_eq!(
            (owner.namespace.as_deref(), owner.pod.as_deref(), owner.container.as_deref()),
            (Some("ml"), Some("train-0"), Some("trainer"))
        );
        // The MIG instance has its own holder, even with no process on it (stranded).
        let mig = attributor.gpu_owner(&gpu(MIG0, 3, Some(GPU2))).expect("held by a pod");
        assert_eq!(mig.pod.as_deref(), Some("jupyter-7"));

        let process = attributor.process(&gpu0, 1001);
        assert_eq!(process.pod.as_deref(), Some("train-0"));
        assert_eq!(process.namespace.as_deref(), Some("ml"));
        assert_eq!(process.container.as_deref(), Some("trainer"));
        assert_eq!(process.pod_uid.as_deref(), Some("8d6c3a5c-1f2b-4a4e-9b1c-2f1e0c9d7a11"));
        assert_eq!(process.container_id.as_deref(), Some(POD_CID));
        assert_eq!(process.user.as_deref(), Some("alice"));

        // A host process on the pod's GPU is not the pod's.
        let host_process = attributor.process(&gpu0, 3003);
        assert_eq!((host_process.pod, host_process.namespace), (None, None));

        // The kubelet goes away: a problem, once.
        kubelet.stop();
        let problems = attributor.refresh();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("pod-resources"), "{problems:?}");
        assert_eq!(attributor.refresh(), Vec::<String>::new(), "reported once");
    }
}

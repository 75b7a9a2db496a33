"""Notices kubelet restarts: the kubelet deletes every socket in its device-plugin directory and
re-creates kubelet.sock. inotify (watchdog) reports it at once; a stat poll backs it up in case an
event is lost (directory re-created, overflow)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from gpupool_deviceplugin.server.registration import KUBELET_SOCKET

log = logging.getLogger(__name__)


class KubeletWatcher(FileSystemEventHandler):
    def __init__(self, kubelet_dir: Path, nudge: Callable[[], None]) -> None:
        super().__init__()
        self.kubelet_dir = kubelet_dir
        self.nudge = nudge  # wakes the supervisor, which decides what to do
        self._observer: BaseObserver | None = None  # Observer: the platform's best BaseObserver

    def start(self) -> None:
        try:
            observer = Observer()
            observer.schedule(self, str(self.kubelet_dir), recursive=False)
            observer.daemon = True
            observer.start()
            self._observer = observer
        except OSError as exc:  # e.g. inotify watch limit reached: polling still works
            log.warning("cannot watch %s with inotify (%s); relying on polling", self.kubelet_dir, exc)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)

    def on_any_event(self, event: FileSystemEvent) -> None:
        name = Path(str(event.src_path)).name
        dest = Path(str(getattr(event, "dest_path", "") or "")).name
        if KUBELET_SOCKET in (name, dest) or name.startswith("gpupool-"):
            self.nudge()


class Supervisor:
    """Keeps the plugin registered: after kubelet.sock is re-created, or our sockets vanish, it
    re-serves and re-registers every resource; failed registrations are retried with backoff."""

    def __init__(self, servers, kubelet_dir: Path, metrics, poll_s: float = 1.0) -> None:
        from gpupool_deviceplugin.server.plugin_servers import kubelet_socket_identity

        self.servers = servers
        self.kubelet_dir = kubelet_dir
        self.metrics = metrics
        self.poll_s = poll_s
        self._identity = kubelet_socket_identity
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-supervisor", daemon=True)
        self.watcher = KubeletWatcher(kubelet_dir, self._wake.set)

    def start(self) -> None:
        self.watcher.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.watcher.stop()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.2
        waiting_logged = False
        while not self._stop.is_set():
            ident = self._identity(self.kubelet_dir)
            if ident is None and not waiting_logged:
                log.info("waiting for the kubelet: %s/kubelet.sock does not exist", self.kubelet_dir)
            waiting_logged = ident is None
            restarted = ident is not None and self.servers.kubelet_identity is not None and \
                ident != self.servers.kubelet_identity
            if restarted or (ident is not None and not self.servers.sockets_present()):
                log.warning("kubelet restarted (kubelet.sock re-created) or our sockets vanished: "
                            "re-serving and re-registering every resource")
                self.metrics.kubelet_restarts.inc()
                self.servers.restart()
            if ident is not None and not self.servers.all_registered():
                if self.servers.register_all():
                    backoff = 0.2
                else:
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
            self.servers.publish_registration(kubelet_up=ident is not None)
            self._wake.wait(self.poll_s)
            self._wake.clear()

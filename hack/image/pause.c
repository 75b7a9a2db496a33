/* The pod sandbox's pause process for the dev cluster's node (image registry.k8s.io/pause:3.10, built by
 * hack/image/build.py with gcc -static -Os). Behaves as upstream Kubernetes' build/pause/linux/pause.c:
 * SIGINT/SIGTERM end it with status 0, SIGCHLD reaps every exited child (it is PID 1 of the pod's PID
 * namespace when that is shared), otherwise it sleeps in pause(); `-v` prints its version. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "3.10-gpupool"

static void sigdown(int signo) {
    psignal(signo, "Shutting down, got signal");
    exit(0);
}

static void sigreap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; ++i) {
        if (!strcasecmp(argv[i], "-v")) {
            printf("pause.c %s\n", VERSION);
            return 0;
        }
    }
    if (getpid() != 1) {
        fprintf(stderr, "Warning: pause should be the first process\n");
    }
    struct sigaction down = {.sa_handler = sigdown};
    struct sigaction reap = {.sa_handler = sigreap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &down, NULL) < 0) return 1;
    if (sigaction(SIGTERM, &down, NULL) < 0) return 2;
    if (sigaction(SIGCHLD, &reap, NULL) < 0) return 3;
    for (;;) {
        pause();
    }
    fprintf(stderr, "Error: infinite loop terminated\n");
    return 42;
}

/* The pod sandbox's first process for the dev cluster's real node: it holds the pod's namespaces
 * open, reaps the zombies of processes reparented to it, and exits on SIGINT or SIGTERM.  Linked
 * statically so its image needs nothing else (FROM scratch); built here, never pulled. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) {
  fprintf(stderr, "pause: stopping on signal %d\n", signo);
  _exit(0);
}

static void on_child(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

static int handle(int signo, void (*handler)(int), int flags) {
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_handler = handler;
  action.sa_flags = flags;
  return sigaction(signo, &action, NULL);
}

int main(void) {
  if (getpid() != 1) fprintf(stderr, "pause: not PID 1 (pid %d); reaping only its own children\n", getpid());
  if (handle(SIGINT, on_stop, 0) || handle(SIGTERM, on_stop, 0) || handle(SIGCHLD, on_child, SA_NOCLDSTOP)) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) pause();
}

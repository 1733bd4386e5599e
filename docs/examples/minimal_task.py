"""A whole task, nothing optional (docs/hub.md): copy the digit shown. Run it from the repository root."""
from envs import MultiTurnEnv, extract_tag, register


class CopyDigitEnv(MultiTurnEnv):
    def _reset_task(self, options):
        self.digit = int(self.np_random.integers(10))

    def instructions(self):
        return "Copy the digit shown: reply <answer>D</answer>."

    def state_text(self):
        return f"Digit: {self.digit}"

    def legal_actions(self):
        return list("0123456789")

    def parse_action(self, reply):
        digit = extract_tag(reply)
        return (int(digit), None) if digit in self.legal_actions() else (None, "answer one digit, 0-9")

    def apply_action(self, digit):
        return float(digit == self.digit), "", True, digit == self.digit


register("examples/CopyDigit-v0", CopyDigitEnv, description="Copy the digit shown (docs/examples/minimal_task.py).")
if __name__ == "__main__":  # python docs/examples/minimal_task.py [train.py flags]: play, then train and evaluate
    import sys, envs.play, train
    envs.play.main(["examples/CopyDigit-v0", "--random", "--seed", "0"])
    sys.exit(train.main(["--env-id", "examples/CopyDigit-v0", *sys.argv[1:]]))

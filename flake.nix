{
  description = "plainrl: a small, hackable PyTorch toolkit for RL post-training of language models";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" "x86_64-darwin" "aarch64-darwin" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in {
      # Python packages still come from requirements.lock (pip into .venv), exactly as `make test` does.
      devShells = forAll (pkgs: {
        default = pkgs.mkShell {
          packages = [ pkgs.python311 pkgs.gnumake pkgs.git pkgs.uv ];
          # torch and friends ship manylinux wheels that expect a conventional libstdc++.
          LD_LIBRARY_PATH = pkgs.lib.makeLibraryPath [ pkgs.stdenv.cc.cc.lib pkgs.zlib ];
          shellHook = ''
            make setup PYTHON=python3.11
            source .venv/bin/activate
          '';
        };
      });
    };
}
